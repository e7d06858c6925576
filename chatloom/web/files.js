// Files in the chat: the attach button, drag and drop onto the page, and pasted files upload to
// POST /files into the open conversation (created first when there is none); the conversation's files
// and collections show as chips above the composer, each with × to detach it. A citation under an
// answer opens its passage inside the whole document, highlighted.
import { ApiError, api } from './api.js';
import { $, el } from './dom.js';
import { addImages, isImage } from './images.js';
import { describeError, showNotice } from './notice.js';

// Images among them go to the next message instead (images.js), for a model that reads them.
// hooks: { conversationId() -> id|null, ensureConversation() -> Promise<id>, notice(message),
//          takesImages() -> bool }
export function setupUploads(hooks) {
  const input = $('file-input');
  $('attach').addEventListener('click', () => input.click());
  input.addEventListener('change', () => { uploadAll([...input.files], hooks); input.value = ''; });
  const app = $('app');
  app.addEventListener('dragover', (e) => {
    if (![...e.dataTransfer.types].includes('Files')) return;
    e.preventDefault();
    app.classList.add('dropping');
  });
  app.addEventListener('dragleave', (e) => { if (e.target === app || !app.contains(e.relatedTarget)) app.classList.remove('dropping'); });
  app.addEventListener('drop', (e) => {
    app.classList.remove('dropping');
    if (!e.dataTransfer.files.length) return;
    e.preventDefault();
    uploadAll([...e.dataTransfer.files], hooks);
  });
  $('input').addEventListener('paste', (e) => {
    const files = [...(e.clipboardData?.files || [])];
    if (!files.length) return;
    e.preventDefault();
    uploadAll(files, hooks);
  });
}

// Uploads in flight: a message sent meanwhile waits for them, so its answer can read the new files.
let pending = Promise.resolve();
export function uploadsSettled() { return pending; }

function uploadAll(files, hooks) {
  const images = files.filter(isImage);
  if (images.length) {
    if (hooks.takesImages()) addImages(images).catch(() => hooks.notice('An image could not be read.'));
    else hooks.notice('The selected model does not read images; choose one that does to send pictures.');
    files = files.filter((f) => !isImage(f));
  }
  if (!files.length) return pending;
  pending = pending.then(() => uploadEach(files, hooks));
  return pending;
}

async function uploadEach(files, hooks) {
  let convId;
  try {
    convId = await hooks.ensureConversation();
  } catch (err) {
    hooks.notice(err.message);
    return;
  }
  const chips = $('attachments');
  for (const file of files) {
    const chip = el('span', { class: 'chip uploading', text: `${file.name} …` });
    chips.hidden = false;
    chips.append(chip);
    try {
      await api.upload(file, convId);
    } catch (err) {
      hooks.notice(`${file.name}: ${err instanceof ApiError ? err.message : 'upload failed'}`);
    }
    chip.remove();
  }
  await showAttachments(convId);
}

// The chips of the files the conversation reads (none for a new chat).
export async function showAttachments(convId) {
  const chips = $('attachments');
  if (!convId) { chips.replaceChildren(); chips.hidden = true; return; }
  let attached = { files: [], collections: [] };
  try { attached = await api.conversationFiles(convId); } catch { /* a server without files: no chips */ }
  const chip = (name, props, detach) => el('span', props, name, el('button', { type: 'button', class: 'chip-remove',
    title: `Detach ${name}`, 'aria-label': `Detach ${name} from this chat`, text: '×', onclick: async () => {
      try { await detach(); } catch (err) { showNotice(`Could not detach ${name}: ${describeError(err)}`); }
      await showAttachments(convId);
    } }));
  chips.replaceChildren(
    ...attached.files.map((f) => chip(f.filename, { class: 'chip', title: f.status_details || f.content_type,
      dataset: { id: f.id } }, () => api.detachFile(convId, f.id))),
    ...attached.collections.map((c) => chip(c.name, { class: 'chip collection', title: 'Collection',
      dataset: { id: c.id } }, () => api.detachCollection(convId, c.id))));
  chips.hidden = !chips.children.length;
}

// The numbered sources under an answer; each opens its passage.
export function sourcesOf(citations) {
  if (!citations || !citations.length) return null;
  return el('div', { class: 'sources' }, el('span', { class: 'muted', text: 'Sources' }),
    citations.map((c) => el('button', { type: 'button', class: 'source', dataset: { n: c.n },
      title: c.text.slice(0, 200), onclick: () => openPassage(c) },
    `[${c.n}] ${c.filename}${c.page ? `, p. ${c.page}` : ''}`)));
}

async function openPassage(c) {
  const dialog = $('passage');
  const body = $('passage-text');
  $('passage-title').textContent = `[${c.n}] ${c.filename}${c.page ? `, page ${c.page}` : ''}`;
  body.replaceChildren(el('mark', { text: c.text }));
  dialog.showModal();
  try {
    const doc = await api.fileText(c.file_id);
    body.replaceChildren(doc.text.slice(0, c.char_start), el('mark', { text: doc.text.slice(c.char_start, c.char_end) }),
      doc.text.slice(c.char_end));
  } catch { /* the file was deleted since: the passage as cited stays shown */ }
  body.querySelector('mark')?.scrollIntoView({ block: 'center' });
}

export function setupPassageDialog() {
  $('passage-close').addEventListener('click', () => $('passage').close());
}
