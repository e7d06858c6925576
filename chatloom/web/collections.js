// The collections in the Files panel: named sets of files a chat reads as one. Create one, add files
// to it, attach it to the open chat or detach it, delete it.
import { api } from './api.js';
import { $, askFirst, el } from './dom.js';

// panel (library.js): { act(what, fn): run a change and redraw, attachButton(name, attached, ref) }
export function setupCollections(panel) {
  $('collection-add').addEventListener('submit', (e) => {
    e.preventDefault();
    const input = $('collection-name');
    const name = input.value.trim();
    if (!name) return;
    panel.act(`create the collection ${name}`, async () => { await api.createCollection(name); input.value = ''; });
  });
}

// One row per collection (each with its files); `attached`: the ids of those the open chat reads.
export function collectionRows(collections, files, attached, panel) {
  if (!collections.length) return [el('li', { class: 'muted', text: 'No collections yet.' })];
  return collections.map((c) => row(c, files, attached.has(c.id), panel));
}

function members(files) {
  if (!files.length) return 'No files yet';
  return `${files.length} file${files.length === 1 ? '' : 's'}: ${files.map((f) => f.filename).join(', ')}`;
}

function row(c, files, attached, panel) {
  const actions = el('span', { class: 'row-actions' }, panel.attachButton(c.name, attached, { collection_id: c.id }),
    el('button', { type: 'button', class: 'link danger delete', 'aria-label': `Delete collection ${c.name}`,
      text: 'Delete', onclick: () => askFirst(actions, 'Delete it, and its files nothing else holds?',
        () => panel.act(`delete ${c.name}`, () => api.deleteCollection(c.id))) }));
  const inside = new Set(c.files.map((f) => f.id));
  const addable = files.filter((f) => !inside.has(f.id));
  const pick = el('select', { class: 'add-file', 'aria-label': `File to add to ${c.name}` },
    addable.map((f) => new Option(f.filename, f.id)));
  const add = addable.length ? el('form', { class: 'add-to-collection', onsubmit: (e) => {
    e.preventDefault();
    panel.act(`add the file to ${c.name}`, () => api.addToCollection(c.id, pick.value));
  } }, pick, el('button', { type: 'submit', text: 'Add file' })) : null;
  return el('li', { class: 'library-collection', dataset: { id: c.id } },
    el('div', { class: 'collection-head' }, el('span', { class: 'name', text: c.name }), actions),
    el('span', { class: 'muted members', text: members(c.files) }), add);
}
