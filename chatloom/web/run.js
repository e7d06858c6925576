// One generation seen from the browser: the text, thinking and tool steps so far, the last event id,
// and the queue position. Every event is mirrored to sessionStorage, so a reloaded page can
// show what it had and resume the stream after the last event it saw.
import { readEvents } from './sse.js';

const KEY = 'chatloom.stream';

export class Run {
  constructor(convId, messageId, { text = '', thinking = '', steps = [], lastEventId = 0 } = {}) {
    this.convId = convId;
    this.messageId = messageId;
    this.text = text;
    this.thinking = thinking;
    this.steps = steps; // tool calls, each with its result once it has one: {id, name, arguments, output, error}
    this.lastEventId = lastEventId;
    this.queue = null; // position while waiting for the model
    this.done = null; // the final {"done": true, ...} event
    this.error = null; // the message of an `event: error`
    this.stopping = false;
    this.reconnecting = false;
    this.controller = new AbortController(); // aborting it only detaches this page
  }

  // The saved state of `messageId` in `convId`, if this tab was following it before a reload.
  static restore(convId, messageId) {
    let saved = null;
    try { saved = JSON.parse(sessionStorage.getItem(KEY)); } catch { /* ignore */ }
    const same = saved && saved.convId === convId && saved.messageId === messageId;
    return new Run(convId, messageId, same ? saved : {});
  }

  save() {
    const { convId, messageId, text, thinking, steps, lastEventId } = this;
    try {
      sessionStorage.setItem(KEY, JSON.stringify({ convId, messageId, text, thinking, steps, lastEventId }));
    } catch { /* storage full or disabled: resuming starts from the beginning */ }
  }

  forget() {
    try {
      const saved = JSON.parse(sessionStorage.getItem(KEY));
      if (!saved || saved.messageId === this.messageId) sessionStorage.removeItem(KEY);
    } catch { sessionStorage.removeItem(KEY); }
  }

  get finished() { return this.done != null || this.error != null; }

  apply(event) {
    if (event.id != null && event.id !== '') this.lastEventId = Number(event.id) || event.id;
    const data = event.data && typeof event.data === 'object' ? event.data : {};
    if (event.event === 'error' || data.error) {
      this.error = data.error?.message || (typeof data.error === 'string' ? data.error : 'the answer failed');
      this.errorStatus = data.error?.status ?? null; // 429 / 503: refused while queued, worth a retry
      this.retryAfter = data.retry_after ?? null;
      return;
    }
    if (typeof data.token === 'string') { this.text += data.token; this.queue = null; }
    if (typeof data.thinking === 'string') { this.thinking += data.thinking; this.queue = null; }
    if (data.tool_call) { this.steps.push({ ...data.tool_call, output: null, error: null }); this.queue = null; }
    if (data.tool_result) {
      const step = this.steps.find((s) => s.id === data.tool_result.id);
      if (step) {
        Object.assign(step, { output: data.tool_result.output, error: data.tool_result.error,
          details: data.tool_result.details });
      }
    }
    if (data.queue_position != null) this.queue = data.queue_position;
    if (data.done) this.done = data;
  }

  // Read a stream Response to its end (or to the final event), calling onChange after each event.
  async follow(response, onChange) {
    for await (const event of readEvents(response)) {
      if (this.controller.signal.aborted) break; // this page let go of the run
      this.reconnecting = false;
      this.apply(event);
      this.save();
      onChange(this);
      if (this.finished) break;
    }
  }
}
