// The Files panel (Files in the sidebar): every file of the account, each with Attach or Detach for the
// open chat and Delete, an Upload button for files that belong to no chat yet, and the collections
// (collections.js). What the API refuses shows in the notice bar, naming the problem.
import { api } from './api.js';
import { collectionRows, setupCollections } from './collections.js';
import { $, askFirst, el } from './dom.js';
import { showAttachments } from './files.js';
import { describeError, hideNotice, showNotice } from './notice.js';

function formatBytes(n) {
  if (n < 1024) return `${n} B`;
  if (n < 1024 * 1024) return `${(n / 1024).toFixed(1)} KB`;
  return `${(n / 1024 / 1024).toFixed(1)} MB`;
}

// hooks: { conversationId() -> id|null, ensureConversation() -> Promise<id> }
export function setupLibrary(hooks) {
  const dialog = $('library');
  const panel = {
    conversationId: hooks.conversationId,
    ensureConversation: hooks.ensureConversation,
    // Run one change against the API, then redraw the panel and the chat's chips. A refusal shows as
    // "Could not <what>: <the server's reason>".
    act: async (what, fn) => {
      try {
        hideNotice();
        await fn();
      } catch (err) {
        showNotice(`Could not ${what}: ${describeError(err)}`);
      }
      await Promise.all([load(panel), showAttachments(hooks.conversationId())]);
    },
  };
  panel.attachButton = (name, attached, ref) => attachButton(name, attached, ref, panel);
  $('open-library').addEventListener('click', () => { dialog.showModal(); load(panel); });
  $('library-close').addEventListener('click', () => dialog.close());
  const input = $('library-input');
  $('library-upload').addEventListener('click', () => input.click());
  input.addEventListener('change', () => {
    const files = [...input.files];
    input.value = '';
    panel.act('upload every file', async () => {
      const failed = [];
      for (const file of files) {
        try { await api.upload(file, null); } catch (err) { failed.push(`${file.name}: ${describeError(err)}`); }
      }
      if (failed.length) throw new Error(failed.join(' '));
    });
  });
  setupCollections(panel);
}

async function load(panel) {
  const convId = panel.conversationId();
  let files, collections, attached;
  try {
    [files, collections, attached] = await Promise.all([api.files(), api.collections(),
      convId ? api.conversationFiles(convId) : { files: [], collections: [] }]);
    const members = await Promise.all(collections.map((c) => api.files(c.id)));
    collections = collections.map((c, i) => ({ ...c, files: members[i] }));
  } catch (err) {
    showNotice(`Could not load your files: ${describeError(err)}`);
    return;
  }
  const list = $('file-list');
  const onChat = new Set(attached.files.map((f) => f.id));
  list.replaceChildren(...(files.length ? files.map((f) => fileRow(f, onChat.has(f.id), panel))
    : [el('li', { class: 'muted', text: 'No files yet. Upload one here, or attach one to a chat.' })]));
  const chatCollections = new Set(attached.collections.map((c) => c.id));
  $('collection-list').replaceChildren(...collectionRows(collections, files, chatCollections, panel));
  // A count of the panel's draws: lets tests (and curious users) see that a change has been shown.
  $('library').dataset.loaded = String(Number($('library').dataset.loaded || 0) + 1);
}

// Attach (to the open chat, made first for a new one) or Detach, whichever applies.
function attachButton(name, attached, ref, panel) {
  const label = attached ? `Detach ${name} from this chat` : `Attach ${name} to this chat`;
  const change = async () => {
    if (!attached) { await api.attach(await panel.ensureConversation(), ref); return; }
    const convId = panel.conversationId();
    await (ref.file_id ? api.detachFile(convId, ref.file_id) : api.detachCollection(convId, ref.collection_id));
  };
  return el('button', { type: 'button', class: `link ${attached ? 'detach' : 'attach'}`, 'aria-label': label,
    title: label, text: attached ? 'Detach' : 'Attach',
    onclick: () => panel.act(`${attached ? 'detach' : 'attach'} ${name}`, change) });
}

function fileRow(f, attached, panel) {
  const actions = el('span', { class: 'row-actions' }, panel.attachButton(f.filename, attached, { file_id: f.id }),
    el('button', { type: 'button', class: 'link danger delete', 'aria-label': `Delete ${f.filename}`, text: 'Delete',
      onclick: () => askFirst(actions, 'Delete for good?',
        () => panel.act(`delete ${f.filename}`, () => api.deleteFile(f.id))) }));
  const note = f.status === 'processed' ? formatBytes(f.bytes) : `${formatBytes(f.bytes)} · ${f.status}`;
  return el('li', { class: 'library-file', dataset: { id: f.id } },
    el('span', { class: 'name', title: f.status_details || f.content_type || '', text: f.filename }),
    el('span', { class: 'muted', text: note }), actions);
}
