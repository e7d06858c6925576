// The account's own places: sharing a conversation (whole, or up to a message), the settings panel
// (custom instructions, memories, shared links, connected sign-on identities, export and import) and
// single sign-on on the login screen.
import { api, request, session } from './api.js';
import { $, el } from './dom.js';
import { describeError, showNotice } from './notice.js';

const enc = encodeURIComponent;

// -- single sign-on ---------------------------------------------------------------------

let ssoInfo = null;
// The outcome of connecting an identity from the settings, read from the address on return.
let linkResult = null;

// After /auth/sso/callback the app opens at /#sso_token=... (signed in) or /#sso_error=... (the reason it
// failed): keep the token, drop both from the address bar, and return the error for the login screen.
// Back from connecting an identity, /#sso_linked=1 or /#sso_link_error=...: still signed in, so the
// outcome is kept for the settings panel instead.
export function takeSsoResult() {
  const params = new URLSearchParams(location.hash.slice(1));
  const token = params.get('sso_token');
  const error = params.get('sso_error');
  if (params.has('sso_linked') || params.has('sso_link_error')) {
    linkResult = { error: params.get('sso_link_error') };
  } else if (!token && !error) return null;
  if (token) session.token = token;
  history.replaceState(null, '', location.pathname + location.search);
  return error;
}

// "Connect <provider>" names the provider as the login button does ("Sign in with Example ID").
function providerName() {
  return (ssoInfo?.label || '').replace(/^sign in with\s+/i, '') || 'single sign-on';
}

export async function setupSso() {
  let info;
  try { info = await request('GET', '/auth/sso'); } catch { return; }
  ssoInfo = info;
  const button = $('sso-button');
  button.hidden = !info.enabled;
  if (info.enabled) button.textContent = info.label;
  for (const node of document.querySelectorAll('.local-login')) node.hidden = !info.local_login;
}

// -- sharing ----------------------------------------------------------------------------

// A link to the conversation's active branch, or (messageId) to the branch from its start up to that
// message: what follows it stays private.
export async function share(conversationId, messageId = null) {
  if (!conversationId) { showNotice('Send a message first: an empty chat has nothing to share.'); return; }
  try {
    const link = await api.share(conversationId, messageId);
    const url = new URL(link.url, location.origin).href;
    const input = $('share-url');
    input.value = url;
    $('share-scope').textContent = messageId
      ? `up to the chosen message (${link.message_count} messages)` : 'as it is now';
    $('share-dialog').showModal();
    input.select();
  } catch (err) {
    showNotice(describeError(err));
  }
}

// -- settings: instructions, memories, links, export and import ---------------------------

function memoryRow(m, reload) {
  const text = el('input', { class: 'memory-text', value: m.text, 'aria-label': 'Memory', maxlength: 500 });
  const save = el('button', { type: 'button', class: 'link', text: 'Save', onclick: () => act('PATCH', { text: text.value }) });
  const confirm = m.status === 'proposed'
    ? el('button', { type: 'button', class: 'link confirm', text: 'Keep', onclick: () => act('POST', undefined, '/confirm') })
    : null;
  const remove = el('button', { type: 'button', class: 'link danger', text: m.status === 'proposed' ? 'Decline' : 'Delete',
    onclick: () => act('DELETE') });
  async function act(method, body, suffix = '') {
    try { await request(method, `/memories/${enc(m.id)}${suffix}`, { body }); await reload(); }
    catch (err) { settingsError(err); }
  }
  return el('li', { class: `memory ${m.status}`, dataset: { id: m.id, status: m.status } },
    m.status === 'proposed' ? el('span', { class: 'badge', text: 'suggested' }) : null, text, save, confirm, remove);
}

function linkRow(s, reload) {
  const url = new URL(s.url, location.origin).href;
  return el('li', { class: 'shared-link', dataset: { id: s.id } },
    el('a', { href: url, target: '_blank', rel: 'noopener', text: s.title }),
    el('span', { class: 'muted', text: ` ${s.message_count} messages` }),
    el('button', { type: 'button', class: 'link danger', text: 'Revoke', onclick: async () => {
      try { await request('DELETE', `/shares/${enc(s.id)}`); await reload(); } catch (err) { settingsError(err); }
    } }));
}

function settingsError(err) {
  const box = $('settings-error');
  box.textContent = err ? describeError(err) : '';
  box.hidden = !err;
}

function identityRow(identity, reload) {
  return el('li', { class: 'linked-identity', dataset: { id: identity.id } },
    el('span', { text: identity.email || identity.issuer }),
    el('span', { class: 'muted', text: ` at ${identity.issuer}` }),
    el('button', { type: 'button', class: 'link danger', text: 'Disconnect', onclick: async () => {
      try { await request('DELETE', `/auth/sso/identities/${enc(identity.id)}`); await reload(); }
      catch (err) { settingsError(err); }
    } }));
}

async function loadIdentities() {
  ssoInfo ??= await request('GET', '/auth/sso');
  const identities = await request('GET', '/auth/sso/identities');
  $('sso-settings').hidden = !ssoInfo?.enabled && !identities.length;
  $('sso-connect').hidden = !ssoInfo?.enabled;
  $('sso-connect').textContent = `Connect ${providerName()}`;
  $('identity-list').replaceChildren(...(identities.length ? identities.map((i) => identityRow(i, loadSettings))
    : [el('li', { class: 'muted', text: 'No identity connected.' })]));
}

// Leave for the provider; its callback links the identity to this account and brings the browser back.
async function connectSso() {
  try {
    const { url } = await request('POST', '/auth/sso/connect');
    location.assign(url);
  } catch (err) { settingsError(err); }
}

async function loadSettings() {
  settingsError(null);
  // Not editable until the saved text is in: typing before it arrives would be overwritten by it.
  $('instructions').disabled = true;
  try {
    const [instructions, memories, links] = await Promise.all([
      request('GET', '/me/instructions'), request('GET', '/memories'), request('GET', '/shares'),
      loadIdentities()]);
    $('instructions').value = instructions.text;
    $('instructions').disabled = false;
    $('memory-list').replaceChildren(...memories.map((m) => memoryRow(m, loadSettings)));
    $('link-list').replaceChildren(...(links.length ? links.map((s) => linkRow(s, loadSettings))
      : [el('li', { class: 'muted', text: 'No shared links.' })]));
  } catch (err) { settingsError(err); }
}

async function download(format) {
  try {
    const res = await request('GET', `/conversations/export?format=${format}`, { raw: true });
    const blob = await res.blob();
    const a = el('a', { href: URL.createObjectURL(blob), download: `chatloom-conversations.${format === 'json' ? 'json' : 'md'}` });
    document.body.append(a);
    a.click();
    a.remove();
    setTimeout(() => URL.revokeObjectURL(a.href), 1000);
  } catch (err) { settingsError(err); }
}

async function importFile(file, onImported) {
  const status = $('import-status');
  status.textContent = 'Importing…';
  try {
    const res = await fetch('/conversations/import', {
      method: 'POST', body: file,
      headers: { Authorization: `Bearer ${session.token}`, 'Content-Type': 'application/json' },
    });
    const body = await res.json().catch(() => ({}));
    if (!res.ok) throw new Error(body?.error?.message || `${res.status} ${res.statusText}`);
    const n = body.conversation_ids.length;
    status.textContent = `Imported ${n} conversation${n === 1 ? '' : 's'} (${body.messages} messages).`;
    onImported();
  } catch (err) {
    status.textContent = '';
    settingsError(err);
  }
}

export function setupAccount({ conversationId, onImported }) {
  $('share').addEventListener('click', () => share(conversationId()));
  $('share-copy').addEventListener('click', () => {
    navigator.clipboard?.writeText($('share-url').value).then(() => { $('share-copy').textContent = 'Copied'; }).catch(() => {});
  });
  $('share-close').addEventListener('click', () => { $('share-dialog').close(); $('share-copy').textContent = 'Copy'; });
  $('open-settings').addEventListener('click', () => { $('settings-dialog').showModal(); loadSettings(); });
  $('settings-close').addEventListener('click', () => {
    $('settings-dialog').close();
    $('sso-link-status').textContent = '';
  });
  $('sso-connect').addEventListener('click', connectSso);
  if (linkResult && session.token) {
    $('sso-link-status').textContent = linkResult.error ? '' : 'Connected: you can now sign in with it.';
    $('settings-dialog').showModal();
    loadSettings().then(() => { if (linkResult.error) settingsError(new Error(linkResult.error)); });
  }
  $('instructions-save').addEventListener('click', async () => {
    try {
      await request('PUT', '/me/instructions', { body: { text: $('instructions').value } });
      $('instructions-save').textContent = 'Saved';
      setTimeout(() => { $('instructions-save').textContent = 'Save'; }, 1500);
      settingsError(null);
    } catch (err) { settingsError(err); }
  });
  $('memory-add').addEventListener('submit', async (e) => {
    e.preventDefault();
    const input = $('memory-new');
    try {
      await request('POST', '/memories', { body: { text: input.value } });
      input.value = '';
      await loadSettings();
    } catch (err) { settingsError(err); }
  });
  $('export-json').addEventListener('click', () => download('json'));
  $('export-markdown').addEventListener('click', () => download('markdown'));
  $('import-file').addEventListener('change', (e) => {
    const file = e.target.files?.[0];
    if (file) importFile(file, onImported);
    e.target.value = '';
  });
}
