// The public page of a shared link (/s/TOKEN): reads GET /shared/TOKEN, no account needed.
import { $, el } from './dom.js';
import { renderMarkdown } from './markdown.js';

function message(m) {
  const bubble = el('div', { class: m.role === 'assistant' ? 'bubble markdown' : 'bubble' });
  if (m.role === 'assistant') bubble.innerHTML = renderMarkdown(m.text); // escaped first: see markdown.js
  else bubble.textContent = m.text;
  return el('div', { class: `message ${m.role}`, dataset: { role: m.role } }, bubble);
}

async function show() {
  const token = decodeURIComponent(location.pathname.split('/').pop() || '');
  const res = await fetch(`/shared/${encodeURIComponent(token)}`);
  if (!res.ok) {
    $('shared-error').textContent = res.status === 404
      ? 'This link does not exist or was revoked by its owner.'
      : `The shared conversation could not be loaded (${res.status}).`;
    $('shared-error').hidden = false;
    return;
  }
  const shared = await res.json();
  document.title = `${shared.title} · chatloom`;
  $('shared-title').textContent = shared.title;
  $('shared-meta').textContent = `Shared ${new Date(shared.created).toLocaleString()} · read only`;
  $('shared-messages').replaceChildren(...shared.messages.map(message));
}

show();
