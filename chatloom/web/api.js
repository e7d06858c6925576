// The HTTP side of the app: the auth token, JSON requests, and errors with their status and Retry-After.

const TOKEN_KEY = 'chatloom.token';

export const session = {
  get token() { return localStorage.getItem(TOKEN_KEY); },
  set token(value) {
    if (value) localStorage.setItem(TOKEN_KEY, value);
    else localStorage.removeItem(TOKEN_KEY);
  },
};

export class ApiError extends Error {
  constructor(status, message, code = null, retryAfter = null) {
    super(message);
    this.status = status;
    this.code = code;
    this.retryAfter = retryAfter; // seconds, or null
  }
}

// Retry-After is either seconds or an HTTP date.
export function parseRetryAfter(value) {
  if (!value) return null;
  const seconds = Number(value);
  if (Number.isFinite(seconds)) return Math.max(0, Math.ceil(seconds));
  const when = Date.parse(value);
  return Number.isNaN(when) ? null : Math.max(0, Math.ceil((when - Date.now()) / 1000));
}

async function toError(res) {
  let message = `${res.status} ${res.statusText}`.trim();
  let code = null;
  try {
    const body = await res.json();
    message = body?.error?.message || (typeof body?.detail === 'string' ? body.detail : message);
    code = body?.error?.code || null;
  } catch { /* not JSON: keep the status line */ }
  return new ApiError(res.status, message, code, parseRetryAfter(res.headers.get('Retry-After')));
}

// Unauthorized answers (an expired token) call this, so the app can show the login screen.
let onUnauthorized = () => {};
export function setUnauthorizedHandler(fn) { onUnauthorized = fn; }

// fetch with the token; JSON in and out. With raw: true the Response comes back (for event streams).
export async function request(method, path, { body, raw = false, headers = {}, signal } = {}) {
  const h = { ...headers };
  if (session.token) h.Authorization = `Bearer ${session.token}`;
  if (body !== undefined) h['Content-Type'] = 'application/json';
  let res;
  try {
    res = await fetch(path, { method, headers: h, signal, body: body === undefined ? undefined : JSON.stringify(body) });
  } catch (err) {
    if (err.name === 'AbortError') throw err;
    throw new ApiError(0, 'Cannot reach the server. Check your connection.', 'network_error', 5);
  }
  if (!res.ok) {
    const error = await toError(res);
    if (res.status === 401 && session.token && !path.startsWith('/auth/')) onUnauthorized(error);
    throw error;
  }
  if (raw) return res;
  if (res.status === 204) return null;
  return res.json();
}

const enc = encodeURIComponent;

// A random key for one send (crypto.randomUUID needs a secure context; getRandomValues does not).
export function sendKey() {
  return Array.from(crypto.getRandomValues(new Uint8Array(16)), (b) => b.toString(16).padStart(2, '0')).join('');
}

export const api = {
  signup: (username, password) => request('POST', '/auth/signup', { body: { username, password } }),
  login: (username, password) => request('POST', '/auth/login', { body: { username, password } }),
  me: () => request('GET', '/auth/me'),

  conversations: () => request('GET', '/conversations?limit=100'),
  searchConversations: (q) => request('GET', `/conversations?limit=50&q=${enc(q)}`),
  createConversation: () => request('POST', '/conversations'),
  conversation: (id, leaf) => request('GET', `/conversations/${enc(id)}${leaf ? `?leaf=${enc(leaf)}` : ''}`),
  rename: (id, title) => request('PATCH', `/conversations/${enc(id)}`, { body: { title } }),
  remove: (id) => request('DELETE', `/conversations/${enc(id)}`),

  // These three answer with an event stream: the caller reads the Response.
  // `key` (Idempotency-Key): the same for every try of one send or regeneration, so a retry after a lost
  // reply is answered with the first try's answer instead of sending the message (or answering) twice.
  send: (id, body, signal, key) => request('POST', `/conversations/${enc(id)}/messages`, {
    body, raw: true, signal, headers: key ? { 'Idempotency-Key': key } : {},
  }),
  regenerate: (id, messageId, body, signal, key) =>
    request('POST', `/conversations/${enc(id)}/messages/${enc(messageId)}/regenerate`, {
      body, raw: true, signal, headers: key ? { 'Idempotency-Key': key } : {},
    }),
  continueAnswer: (id, messageId, body, signal) =>
    request('POST', `/conversations/${enc(id)}/messages/${enc(messageId)}/continue`, { body, raw: true, signal }),
  resume: (id, messageId, lastEventId, signal) => request('GET', `/conversations/${enc(id)}/stream?message_id=${enc(messageId)}`, {
    raw: true, signal, headers: lastEventId ? { 'Last-Event-ID': String(lastEventId) } : {},
  }),
  stop: (id) => request('POST', `/conversations/${enc(id)}/stop`),

  upload: async (file, conversationId) => {
    const form = new FormData();
    form.append('file', file, file.name);
    if (conversationId) form.append('conversation_id', conversationId);
    const headers = session.token ? { Authorization: `Bearer ${session.token}` } : {};
    let res;
    try {
      res = await fetch('/files', { method: 'POST', headers, body: form });
    } catch {
      throw new ApiError(0, 'Cannot reach the server. Check your connection.', 'network_error', 5);
    }
    if (!res.ok) throw await toError(res);
    return res.json();
  },
  conversationFiles: (id) => request('GET', `/conversations/${enc(id)}/files`),
  fileText: (id) => request('GET', `/files/${enc(id)}/text`),
  files: (collectionId) => request('GET', collectionId ? `/files?collection_id=${enc(collectionId)}` : '/files'),
  deleteFile: (id) => request('DELETE', `/files/${enc(id)}`),
  collections: () => request('GET', '/collections'),
  createCollection: (name) => request('POST', '/collections', { body: { name } }),
  deleteCollection: (id) => request('DELETE', `/collections/${enc(id)}`),
  addToCollection: (id, fileId) => request('POST', `/collections/${enc(id)}/files`, { body: { file_id: fileId } }),
  // ref: { file_id } or { collection_id }
  attach: (convId, ref) => request('POST', `/conversations/${enc(convId)}/files`, { body: ref }),
  detachFile: (convId, fileId) => request('DELETE', `/conversations/${enc(convId)}/files/${enc(fileId)}`),
  detachCollection: (convId, collectionId) =>
    request('DELETE', `/conversations/${enc(convId)}/collections/${enc(collectionId)}`),
  // The active branch, or the branch from the root up to messageId.
  share: (convId, messageId) => request('POST', `/conversations/${enc(convId)}/shares`,
    messageId ? { body: { message_id: messageId } } : {}),

  feedback: (messageId, rating) => request('POST', `/messages/${enc(messageId)}/feedback`, { body: { rating } }),
  models: () => request('GET', '/v1/models'),
  usage: () => request('GET', '/usage'),
};
