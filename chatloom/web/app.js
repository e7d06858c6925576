// The chat app's entry point: holds the state and wires the screens (auth, sidebar, messages,
// composer) to the API. Rendering lives in messages.js / sidebar.js, streaming in run.js.
import { setupAccount, setupSso, share, takeSsoResult } from './account.js';
import { api, sendKey, session, setUnauthorizedHandler } from './api.js';
import { $, nearBottom } from './dom.js';
import { setupPassageDialog, setupUploads, showAttachments, uploadsSettled } from './files.js';
import { clearImages, pendingImages, setupMicrophone } from './images.js';
import { setupLibrary } from './library.js';
import { renderBranch, streamingMessage, updateStreaming } from './messages.js';
import { describeError, hideNotice, setupNotice, showNotice } from './notice.js';
import { Run } from './run.js';
import { renderSidebar } from './sidebar.js';
import { renderUsage } from './usage.js';

const state = {
  searching: false, // the sidebar lists search results (the search box has words)
  user: null,
  conversations: [],
  convId: null, // null: a new chat, created on the first message
  title: 'New chat',
  branch: [], // the messages shown, root first
  leaf: null, // the message whose branch the user picked with ‹ › (null: the newest)
  run: null, // the generation this page is following
  thoughts: new Map(), // message id -> thinking text seen while it streamed
};

const narrow = () => window.matchMedia('(max-width: 760px)').matches;
const messagesBox = () => $('messages');

// -- sign in --------------------------------------------------------------------

function showAuth(message) {
  state.run?.controller.abort();
  session.token = null;
  $('app').hidden = true;
  $('auth').hidden = false;
  const error = $('auth-error');
  error.hidden = !message;
  error.textContent = message || '';
  $('auth-username').focus();
}

async function submitAuth(event) {
  event.preventDefault();
  const mode = event.submitter?.dataset.mode || 'login';
  const username = $('auth-username').value.trim();
  const password = $('auth-password').value;
  const error = $('auth-error');
  error.hidden = true;
  try {
    const result = mode === 'signup' ? await api.signup(username, password) : await api.login(username, password);
    session.token = result.token;
    state.user = result.user || await api.me();
    $('auth-password').value = '';
    await enterApp();
  } catch (err) {
    error.textContent = describeError(err);
    error.hidden = false;
  }
}

// -- the app shell ------------------------------------------------------------------

async function enterApp() {
  $('auth').hidden = true;
  $('app').hidden = false;
  $('username').textContent = state.user?.username || '';
  $('username').title = state.user?.username || '';
  $('ops-link').hidden = !state.user?.is_admin; // the API refuses everyone else anyway
  loadModels();
  refreshUsage();
  await refreshConversations();
  const params = new URLSearchParams(location.hash.slice(1));
  const id = params.get('c');
  if (id && state.conversations.some((c) => c.id === id)) await openConversation(id, params.get('leaf'));
  else newChat();
}

async function loadModels() {
  const select = $('model');
  try {
    const { data } = await api.models();
    const chat = data.filter((m) => m.capabilities?.chat !== false); // the speech model takes audio only
    state.vision = new Set(chat.filter((m) => m.capabilities?.vision).map((m) => m.id));
    $('mic').hidden = !data.some((m) => m.capabilities?.audio) || !window.MediaRecorder;
    const saved = localStorage.getItem('chatloom.model');
    select.replaceChildren(...chat.map((m) => new Option(m.id, m.id)));
    if (saved && chat.some((m) => m.id === saved)) select.value = saved;
  } catch {
    select.replaceChildren(new Option('default model', ''));
  }
}

async function refreshUsage() {
  try {
    renderUsage($('usage'), await api.usage());
  } catch {
    $('usage').hidden = true; // no /usage on this server (or it failed): show nothing
  }
}

async function refreshConversations() {
  const q = $('search').value.trim();
  try {
    state.conversations = q ? await api.searchConversations(q) : await api.conversations();
    state.searching = Boolean(q);
  } catch (err) {
    if (err.status !== 401) showNotice(describeError(err));
  }
  drawSidebar();
}

// The search box: results follow typing, a moment after the last key (one request per pause).
let searchTimer = null;
function onSearchInput() {
  clearTimeout(searchTimer);
  searchTimer = setTimeout(refreshConversations, 200);
}

function drawSidebar() {
  renderSidebar($('conversation-list'), state.conversations, state.convId, {
    // A search hit in a message opens the branch through that message.
    open: (id, messageId) => { openConversation(id, messageId || null); closeDrawer(); },
    rename: async (id, title) => {
      try { await api.rename(id, title); } catch (err) { showNotice(describeError(err)); }
      await refreshConversations();
      if (id === state.convId) setTitle(title);
    },
    remove: async (id) => {
      try { await api.remove(id); } catch (err) { if (err.status !== 404) showNotice(describeError(err)); }
      if (id === state.convId) newChat();
      await refreshConversations();
    },
  }, state.searching);
}

function setTitle(title) {
  state.title = title || 'New chat';
  $('title').textContent = state.title;
  document.title = state.convId ? `${state.title} · chatloom` : 'chatloom';
}

// #c=CONVERSATION, plus &leaf=MESSAGE while another branch than the newest is shown, so a reload keeps it.
function setHash() {
  const leaf = state.convId && state.leaf ? `&leaf=${encodeURIComponent(state.leaf)}` : '';
  const hash = state.convId ? `#c=${encodeURIComponent(state.convId)}${leaf}` : '';
  if (location.hash !== hash) history.replaceState(null, '', `${location.pathname}${location.search}${hash}`);
}

// Leave the generation we follow running on the server; only this page stops listening.
function detach() {
  if (state.run) {
    state.run.controller.abort();
    state.run = null;
    setRunning(false);
  }
}

function newChat() {
  detach();
  hideNotice();
  state.convId = null;
  state.leaf = null;
  state.branch = [];
  setTitle('New chat');
  setHash();
  drawMessages();
  drawSidebar();
  showAttachments(null);
  $('input').focus();
}

// The open conversation, created now if this is a new chat (files attach to a conversation).
async function ensureConversation() {
  if (state.convId) return state.convId;
  const conv = await api.createConversation();
  state.convId = conv.id;
  setHash();
  await refreshConversations();
  return conv.id;
}

async function openConversation(id, leaf = null) {
  if (id !== state.convId) detach();
  let conv;
  try {
    conv = await api.conversation(id, leaf);
  } catch (err) {
    if (err.status === 404 && leaf) return openConversation(id); // a stale branch link: show the newest
    showNotice(describeError(err));
    if (err.status === 404) { newChat(); refreshConversations(); }
    return;
  }
  if (id !== state.convId) showAttachments(id);
  state.convId = id;
  state.leaf = leaf;
  state.branch = conv.messages;
  setTitle(conv.title);
  setHash();
  drawSidebar();
  drawMessages();
  scrollToBottom(true);
  if (conv.generating && !state.run) attach(id, conv.generating);
}

// -- messages -----------------------------------------------------------------

const messageActions = {
  thoughtOf: (id) => state.thoughts.get(id),
  showSibling: (id) => openConversation(state.convId, id),
  edit: (m, text) => {
    const key = sendKey(); // every retry of this edit keeps it
    return generate(() => api.send(state.convId, { text, parent_id: m.parent_id ?? null, ...options() }, undefined, key));
  },
  regenerate: (m) => {
    const key = sendKey();
    return generate(() => api.regenerate(state.convId, m.id, options(), undefined, key));
  },
  continue: (m) => generate(() => api.continueAnswer(state.convId, m.id, options())),
  copy: (text) => navigator.clipboard?.writeText(text).catch(() => {}),
  share: (m) => share(state.convId, m.id),
  feedback: async (m, rating, button) => {
    try {
      await api.feedback(m.id, rating);
      m.feedback = rating;
      button.closest('.toolbar').querySelectorAll('.thumb')
        .forEach((b) => b.setAttribute('aria-pressed', String(b === button)));
    } catch (err) {
      showNotice(err.status === 404 || err.status === 405 ? 'Feedback is not available on this server.'
        : describeError(err));
    }
  },
};

function drawMessages() {
  const box = messagesBox();
  if (!state.branch.length && !state.run) {
    box.replaceChildren($('empty') || emptyState());
    return;
  }
  renderBranch(box, state.branch, messageActions, { runningId: state.run?.messageId ?? null, convId: state.convId });
  if (state.run) drawRun();
}

function emptyState() {
  const div = document.createElement('div');
  div.id = 'empty';
  div.className = 'empty';
  div.innerHTML = '<h1>How can I help?</h1>';
  return div;
}

let frame = 0;
function drawRun() {
  const run = state.run;
  if (!run || run.convId !== state.convId) return;
  let node = messagesBox().querySelector(`.message[data-id="${CSS.escape(run.messageId)}"]`);
  if (!node) {
    node = streamingMessage(run.messageId);
    messagesBox().append(node);
  }
  const stick = nearBottom(messagesBox());
  updateStreaming(node, run);
  if (stick) scrollToBottom(true);
}

// Redraw at most once per animation frame, however fast tokens come.
function scheduleDraw() {
  if (!frame) frame = requestAnimationFrame(() => { frame = 0; drawRun(); });
}

function scrollToBottom(force = false) {
  const box = messagesBox();
  if (force || nearBottom(box)) box.scrollTop = box.scrollHeight;
}

// -- generating ---------------------------------------------------------------

function options() {
  const body = {};
  const model = $('model').value;
  if (model) body.model = model;
  if ($('reasoning').checked) body.reasoning_effort = $('effort').value;
  return body;
}

function setRunning(running) {
  $('send').hidden = running;
  $('stop').hidden = !running;
  $('stop').disabled = false;
  document.body.classList.toggle('generating', running);
}

// Start an answer: `start()` POSTs and resolves to the event-stream Response.
async function generate(start, { onStarted = () => {} } = {}) {
  if (state.run) return false;
  hideNotice();
  $('send').disabled = true;
  let response;
  try {
    response = await start();
  } catch (err) {
    $('send').disabled = false;
    const retry = err.status === 429 || err.status === 503 || err.status === 0;
    showNotice(describeError(err), retry ? { retryAfter: err.retryAfter, onRetry: () => generate(start, { onStarted }) } : {});
    // Already answering here (another tab?): show that answer as it is written.
    if (err.status === 409 && state.convId) openConversation(state.convId);
    return false;
  }
  $('send').disabled = false;
  onStarted();
  const convId = state.convId;
  const run = new Run(convId, response.headers.get('X-Message-Id'));
  state.run = run;
  state.leaf = null; // the new answer's branch is the conversation's newest
  setHash();
  setRunning(true);
  // The server has saved the question and an empty answer: show that branch, then stream into it.
  try {
    const conv = await api.conversation(convId, run.messageId);
    if (state.convId === convId) {
      state.branch = conv.messages;
      setTitle(conv.title);
    }
  } catch { /* the stream still shows the answer */ }
  drawMessages();
  scrollToBottom(true);
  refreshConversations();
  await follow(run, response);
  return true;
}

// Reattach to an answer that is still being written (after a reload, or on opening its conversation).
function attach(convId, messageId) {
  const run = Run.restore(convId, messageId);
  state.run = run;
  setRunning(true);
  drawMessages();
  follow(run, null);
}

// Read the run's stream to its end; a dropped connection resumes after the last event seen.
async function follow(run, response) {
  let attempts = 0;
  while (!run.finished && state.run === run) {
    try {
      if (!response) response = await api.resume(run.convId, run.messageId, run.lastEventId, run.controller.signal);
      await run.follow(response, scheduleDraw);
      attempts = 0;
    } catch (err) {
      if (err.name === 'AbortError' || state.run !== run) return; // detached
      if (err.status === 404 || err.status === 405) { await waitForSaved(run); break; }
      if (++attempts > 5) { run.error = describeError(err); break; }
      run.reconnecting = true;
      scheduleDraw();
      await new Promise((r) => setTimeout(r, 500 * attempts));
    }
    response = null;
  }
  if (state.run === run) finish(run);
}

// Without a resumable stream, poll until the answer is saved.
async function waitForSaved(run) {
  while (state.run === run) {
    try {
      const conv = await api.conversation(run.convId);
      if (conv.generating !== run.messageId) return;
    } catch { return; }
    await new Promise((r) => setTimeout(r, 1000));
  }
}

async function finish(run) {
  run.forget();
  if (run.thinking) state.thoughts.set(run.messageId, run.thinking);
  state.run = null;
  setRunning(false);
  if (run.error) {
    const later = run.errorStatus === 429 || run.errorStatus === 503;
    const text = describeError({ status: run.errorStatus, message: run.error });
    const retryKey = sendKey(); // one new answer, however often its start is retried
    showNotice(later ? text : `The answer failed: ${text}`, later ? {
      retryAfter: run.retryAfter,
      onRetry: () => generate(() => api.regenerate(run.convId, run.messageId, options(), undefined, retryKey)),
    } : {});
  }
  if (run.convId === state.convId) {
    // The saved answer replaces the streamed one; a failed fetch (a busy server) is retried
    // a few times before falling back to what is shown.
    for (let attempt = 0; attempt < 3; attempt++) {
      try {
        const conv = await api.conversation(run.convId, run.messageId);
        state.branch = conv.messages;
        setTitle(conv.title);
        break;
      } catch {
        await new Promise((r) => setTimeout(r, 300 * (attempt + 1)));
      }
    }
    drawMessages();
  }
  await Promise.all([refreshConversations(), refreshUsage()]);
  // A counter of finished answers: lets tests (and curious users) see that everything is settled.
  document.body.dataset.answers = String(Number(document.body.dataset.answers || 0) + 1);
}

async function stop() {
  const run = state.run;
  if (!run || run.stopping) return;
  run.stopping = true;
  $('stop').disabled = true;
  try {
    await api.stop(run.convId);
  } catch (err) {
    run.stopping = false;
    $('stop').disabled = false;
    showNotice(describeError(err));
  }
}

async function sendFromComposer() {
  const input = $('input');
  const text = input.value.trim();
  if (!text || state.run) return;
  await uploadsSettled(); // files being attached are read by this message's answer
  if (!state.convId) {
    try {
      const conv = await api.createConversation();
      state.convId = conv.id;
      setHash();
    } catch (err) {
      showNotice(describeError(err), { retryAfter: err.retryAfter, onRetry: sendFromComposer });
      return;
    }
  }
  // Continue the branch on screen (not necessarily the last one written).
  const last = state.branch[state.branch.length - 1];
  const body = { text, ...options() };
  const images = pendingImages();
  if (images.length) body.images = images;
  if (last?.role === 'assistant') body.parent_id = last.id;
  const convId = state.convId;
  const key = sendKey(); // every retry of this send keeps it
  await generate(() => api.send(convId, body, undefined, key), {
    onStarted: () => { input.value = ''; autosize(); clearImages(); },
  });
}

// -- composer, keys, layout -------------------------------------------------------------

// Transcribed speech goes into the box where the cursor is, for the user to read and send.
function insertSpeech(text) {
  const input = $('input');
  const at = input.selectionStart ?? input.value.length;
  const before = input.value.slice(0, at);
  const spaced = before && !/\s$/.test(before) && text ? ` ${text}` : text;
  input.value = before + spaced + input.value.slice(input.selectionEnd ?? at);
  autosize();
  input.focus();
}

function autosize() {
  const input = $('input');
  input.style.height = 'auto';
  input.style.height = `${Math.min(input.scrollHeight, 200)}px`;
}

function closeDrawer() { document.body.classList.remove('sidebar-open'); }

function wire() {
  setupNotice();
  setUnauthorizedHandler(() => showAuth('Your session has ended. Please log in again.'));
  $('auth-form').addEventListener('submit', submitAuth);
  $('composer').addEventListener('submit', (e) => { e.preventDefault(); sendFromComposer(); });
  $('input').addEventListener('keydown', (e) => {
    if (e.key === 'Enter' && !e.shiftKey && !e.isComposing) {
      e.preventDefault();
      sendFromComposer();
    }
  });
  $('input').addEventListener('input', autosize);
  $('stop').addEventListener('click', stop);
  document.addEventListener('keydown', (e) => {
    if (e.key === 'Escape' && state.run) { e.preventDefault(); stop(); }
  });
  $('new-chat').addEventListener('click', () => { newChat(); closeDrawer(); });
  $('search').addEventListener('input', onSearchInput);
  setupUploads({ ensureConversation, notice: (message) => showNotice(message),
    takesImages: () => state.vision?.has($('model').value) ?? false });
  setupMicrophone({ notice: (message) => showNotice(message), onText: insertSpeech });
  setupPassageDialog();
  setupLibrary({ conversationId: () => state.convId, ensureConversation });
  $('search').addEventListener('keydown', (e) => {
    if (e.key === 'Escape' && $('search').value) { e.stopPropagation(); $('search').value = ''; refreshConversations(); }
  });
  $('logout').addEventListener('click', () => { detach(); showAuth(); });
  $('menu').addEventListener('click', () => document.body.classList.toggle('sidebar-open'));
  $('scrim').addEventListener('click', closeDrawer);
  $('model').addEventListener('change', () => localStorage.setItem('chatloom.model', $('model').value));
  $('reasoning').addEventListener('change', () => { $('effort').disabled = !$('reasoning').checked; });
  // Copy buttons inside rendered code blocks.
  messagesBox().addEventListener('click', (e) => {
    const button = e.target.closest('.copy-code');
    if (!button) return;
    const code = button.closest('.code-block')?.querySelector('code')?.textContent ?? '';
    navigator.clipboard?.writeText(code).then(() => { button.textContent = 'Copied'; }).catch(() => {});
  });
  if (narrow()) closeDrawer();
  setupAccount({ conversationId: () => state.convId, onImported: refreshConversations });
}

async function main() {
  // Back from single sign-on: the session token, or why it failed, is in the address's fragment.
  const ssoError = takeSsoResult();
  wire();
  setupSso();
  if (ssoError || !session.token) { showAuth(ssoError); return; }
  try {
    state.user = await api.me();
  } catch (err) {
    if (err.status === 401) return showAuth();
    showAuth(describeError(err));
    return;
  }
  await enterApp();
}

main();
