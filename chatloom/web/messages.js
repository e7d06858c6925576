// The message view: one branch of the conversation tree, as bubbles with their tools
// (‹ 2/3 › between siblings, edit for questions, copy / regenerate / thumbs / share up to here for answers).
import { el } from './dom.js';
import { sourcesOf } from './files.js';
import { icon } from './icons.js';
import { renderMarkdown } from './markdown.js';
import { codeStep } from './code_step.js';
import { messageImages } from './images.js';

const STATUS_TEXT = { stopped: 'Stopped', incomplete: 'Cut off at the length limit', error: 'Failed',
  filtered: 'Withheld by the content filter', interrupted: 'Interrupted' };

// An interrupted answer (the server stopped while writing it) says why and offers to go on from
// its saved text or to write a new one.
function interruptedLine(m, actions, busy) {
  return el('div', { class: 'status-line interrupted' },
    el('span', { class: 'reason', text: m.interrupted_reason ? `Interrupted: ${m.interrupted_reason}.` : 'Interrupted.' }),
    m.text ? el('button', { type: 'button', class: 'continue', disabled: busy, onclick: () => actions.continue(m) },
      'Continue') : null,
    el('button', { type: 'button', class: 'regenerate-answer', disabled: busy, onclick: () => actions.regenerate(m) },
      'Regenerate'));
}

// ‹ i/n › for a message that has siblings; `go(id)` shows the branch through that sibling.
function siblingNav(message, go, busy) {
  const ids = message.sibling_ids || [message.id];
  if (ids.length < 2) return null;
  const i = message.sibling_index ?? ids.indexOf(message.id);
  return el('span', { class: 'siblings' },
    el('button', { type: 'button', class: 'prev', 'aria-label': 'Previous version', disabled: busy || i === 0,
      onclick: () => go(ids[i - 1]) }, '‹'),
    el('span', { class: 'position' }, `${i + 1}/${ids.length}`),
    el('button', { type: 'button', class: 'next', 'aria-label': 'Next version', disabled: busy || i === ids.length - 1,
      onclick: () => go(ids[i + 1]) }, '›'));
}

function userMessage(m, actions, busy) {
  const node = el('div', { class: 'message user', dataset: { id: m.id, role: 'user' } });
  const bubble = el('div', { class: 'bubble', text: m.text });
  const edit = el('button', { type: 'button', class: 'edit', title: 'Edit', 'aria-label': 'Edit', disabled: busy,
    onclick: () => startEdit() }, icon('edit'));
  const toolbar = el('div', { class: 'toolbar' }, siblingNav(m, actions.showSibling, busy), edit);
  const images = messageImages(m.images);
  node.append(...(images ? [images] : []), bubble, toolbar);

  // Editing swaps the bubble for a text box; saving sends the new text as a sibling (a new branch).
  function startEdit() {
    const box = el('textarea', { class: 'edit-input', 'aria-label': 'Edit message' });
    box.value = m.text;
    const save = () => { const text = box.value.trim(); if (text) actions.edit(m, text); };
    box.addEventListener('keydown', (e) => {
      if (e.key === 'Enter' && !e.shiftKey && !e.isComposing) { e.preventDefault(); save(); }
      if (e.key === 'Escape') { e.stopPropagation(); cancel(); }
    });
    const form = el('div', { class: 'edit-box' }, box, el('div', { class: 'row' },
      el('button', { type: 'button', class: 'cancel', onclick: () => cancel() }, 'Cancel'),
      el('button', { type: 'button', class: 'primary save', onclick: save }, 'Send')));
    node.replaceChildren(form);
    box.focus();
    function cancel() { node.replaceChildren(...(images ? [images] : []), bubble, toolbar); }
  }
  return node;
}

// The tools an answer used, each a collapsed step: "calculator · 391", opening to the arguments and result.
function toolSteps(steps, convId) {
  if (!steps || !steps.length) return null;
  return el('div', { class: 'tool-steps' }, steps.map((s) => {
    if (s.name === 'python') return codeStep(s, convId);
    const result = s.error ? `error: ${s.error}` : s.output;
    const summary = result == null ? `Using ${s.name}…` : `Used ${s.name}: ${result.split('\n')[0].slice(0, 80)}`;
    return el('details', { class: `tool-step${s.error ? ' failed' : ''}`, dataset: { tool: s.name } },
      el('summary', { text: summary }),
      el('div', { class: 'tool-label', text: 'Arguments' }), el('pre', { class: 'tool-args', text: s.arguments }),
      el('div', { class: 'tool-label', text: 'Result' }),
      el('pre', { class: 'tool-result', text: result ?? 'running…' }));
  }));
}

function assistantMessage(m, actions, busy, convId) {
  const node = el('div', { class: 'message assistant', dataset: { id: m.id, role: 'assistant', status: m.status } });
  const bubble = el('div', { class: 'bubble markdown' });
  bubble.innerHTML = renderMarkdown(m.text); // escaped first: see markdown.js
  const status = STATUS_TEXT[m.status];
  const line = m.status === 'interrupted' ? interruptedLine(m, actions, busy)
    : status ? el('div', { class: `status-line ${m.status === 'error' ? 'error' : ''}`,
      text: m.error ? `${status}: ${m.error}` : status }) : null;
  const thumb = (rating, label) => el('button', {
    type: 'button', class: `thumb thumb-${rating}`, 'aria-label': label, title: label,
    'aria-pressed': String(m.feedback === rating || m.feedback?.rating === rating),
    onclick: (e) => actions.feedback(m, rating, e.currentTarget),
  }, icon(rating));
  const toolbar = el('div', { class: 'toolbar' },
    siblingNav(m, actions.showSibling, busy),
    el('button', { type: 'button', class: 'copy', title: 'Copy', 'aria-label': 'Copy',
      onclick: () => actions.copy(m.text) }, icon('copy')),
    el('button', { type: 'button', class: 'regenerate', title: 'Regenerate', 'aria-label': 'Regenerate', disabled: busy,
      onclick: () => actions.regenerate(m) }, icon('regenerate')),
    thumb('up', 'Good answer'), thumb('down', 'Bad answer'),
    el('button', { type: 'button', class: 'share-upto', title: 'Share the chat up to this answer',
      'aria-label': 'Share up to here', onclick: () => actions.share(m) }, icon('share')));
  // The thinking is stored with the answer; the one this page watched streaming is used until a reload.
  const thought = m.reasoning || actions.thoughtOf?.(m.id);
  const thinking = thought ? el('details', { class: 'thinking' }, el('summary', {}, 'Thought about it'),
    el('div', { class: 'thought', text: thought })) : null;
  const steps = toolSteps(m.tool_steps, convId);
  const sources = sourcesOf(m.citations);
  node.append(...(thinking ? [thinking] : []), ...(steps ? [steps] : []), bubble, ...(sources ? [sources] : []),
    ...(line ? [line] : []), toolbar);
  return node;
}

// Draw a whole branch. `runningId` is the answer being streamed (drawn by updateStreaming instead).
export function renderBranch(container, messages, actions, { runningId = null, convId = null } = {}) {
  const busy = runningId != null;
  const nodes = messages.map((m) => {
    if (m.role === 'user') return userMessage(m, actions, busy);
    if (m.id === runningId) return streamingMessage(m.id);
    return assistantMessage(m, actions, busy, convId);
  });
  container.replaceChildren(...nodes);
}

// An answer still being written: optional collapsed thinking, the text so far, a queue line.
export function streamingMessage(id) {
  return el('div', { class: 'message assistant streaming', dataset: { id, role: 'assistant', status: 'streaming' } },
    el('details', { class: 'thinking', hidden: true }, el('summary', {}, 'Thinking…'), el('div', { class: 'thought' })),
    el('div', { class: 'tool-steps-slot' }),
    el('div', { class: 'bubble markdown cursor' }),
    el('div', { class: 'status-line queue', hidden: true }));
}

export function updateStreaming(node, run) {
  const thinking = node.querySelector('.thinking');
  if (run.thinking) {
    thinking.hidden = false;
    thinking.querySelector('.thought').textContent = run.thinking;
    thinking.querySelector('summary').textContent = run.text ? 'Thought about it' : 'Thinking…';
  }
  const slot = node.querySelector('.tool-steps-slot');
  if (run.steps.length && slot.dataset.drawn !== JSON.stringify(run.steps)) {
    // Redrawn only when a step changes, so a step the user opened stays open while text streams.
    const open = new Set([...slot.querySelectorAll('details[open]')].map((d) => d.dataset.index));
    const steps = toolSteps(run.steps, run.convId);
    steps.querySelectorAll('details').forEach((d, i) => { d.dataset.index = i; if (open.has(String(i))) d.open = true; });
    slot.replaceChildren(steps);
    slot.dataset.drawn = JSON.stringify(run.steps);
  }
  node.querySelector('.bubble').innerHTML = renderMarkdown(run.text);
  const queue = node.querySelector('.queue');
  const waiting = run.queue != null && !run.text && !run.thinking && !run.steps.length;
  queue.hidden = !waiting && !run.reconnecting;
  queue.textContent = run.reconnecting ? 'Reconnecting…'
    : waiting ? (run.queue > 0 ? `Waiting in queue: position ${run.queue}` : 'Starting…') : '';
}
