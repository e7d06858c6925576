// The conversation list: newest first, open on click, rename in place, delete with a confirm step.
// While the search box has words, the list is the search's results (best first), each with its snippet.
import { el } from './dom.js';
import { icon } from './icons.js';

export function renderSidebar(container, conversations, activeId, actions, searching = false) {
  const rows = conversations.map((c) => row(c, c.id === activeId, actions));
  const empty = searching ? 'No conversation matches.' : 'No conversations yet.';
  container.replaceChildren(...(rows.length ? rows : [el('p', { class: 'muted', text: empty })]));
}

// The server's snippet is escaped text with the matches in <mark>; rebuilt here from text nodes and
// <mark> elements only, so nothing else in it could ever become markup.
function snippet(html) {
  const template = document.createElement('template');
  template.innerHTML = html;
  const parts = [...template.content.childNodes].map((n) =>
    n.nodeName === 'MARK' ? el('mark', { text: n.textContent }) : document.createTextNode(n.textContent));
  return el('span', { class: 'snippet' }, parts);
}

function row(conv, active, actions) {
  const node = el('div', { class: `conversation${active ? ' active' : ''}`, dataset: { id: conv.id } });
  const open = el('button', { type: 'button', class: 'open', title: conv.title,
    onclick: () => actions.open(conv.id, conv.message_id || null) },
  conv.snippet != null ? [el('span', { class: 'title', text: conv.title }), snippet(conv.snippet)] : conv.title);
  const tools = el('span', { class: 'actions' },
    el('button', { type: 'button', class: 'rename', title: 'Rename', 'aria-label': 'Rename', onclick: rename }, icon('edit')),
    el('button', { type: 'button', class: 'delete', title: 'Delete', 'aria-label': 'Delete', onclick: confirmDelete }, icon('trash')));
  node.append(open, tools);

  function rename() {
    const input = el('input', { class: 'rename-input', 'aria-label': 'Conversation title', maxlength: 200 });
    input.value = conv.title;
    let settled = false;
    const finish = (save) => {
      if (settled) return;
      settled = true;
      const title = input.value.trim();
      if (save && title && title !== conv.title) actions.rename(conv.id, title);
      else node.replaceChildren(open, tools);
    };
    input.addEventListener('keydown', (e) => {
      if (e.key === 'Enter') { e.preventDefault(); finish(true); }
      if (e.key === 'Escape') { e.stopPropagation(); finish(false); }
    });
    input.addEventListener('blur', () => finish(true));
    node.replaceChildren(input);
    input.focus();
    input.select();
  }

  function confirmDelete() {
    const confirm = el('span', { class: 'actions confirming' },
      el('span', { class: 'muted', text: 'Delete?' }),
      el('button', { type: 'button', class: 'yes', onclick: () => actions.remove(conv.id) }, 'Yes'),
      el('button', { type: 'button', class: 'no', onclick: () => node.replaceChildren(open, tools) }, 'No'));
    node.replaceChildren(open, confirm);
  }
  return node;
}
