// A step of the code interpreter: the code highlighted, its output collapsible, plots inline and the
// files it wrote as downloads. The files are fetched with the session's token (an <img src> or a
// plain link could not send it), then shown from a local object URL.
import { el } from './dom.js';
import { request } from './api.js';
import { highlightPython } from './highlight.js';

function fileUrl(convId, file) {
  return `/conversations/${encodeURIComponent(convId)}/tool-files/${encodeURIComponent(file.id)}`;
}

async function objectUrl(convId, file) {
  const res = await request('GET', fileUrl(convId, file), { raw: true });
  return URL.createObjectURL(await res.blob());
}

function plot(convId, file) {
  const img = el('img', { class: 'tool-plot', alt: file.name });
  objectUrl(convId, file).then((url) => { img.src = url; }, () => { img.alt = `${file.name} (not available)`; });
  return img;
}

function download(convId, file) {
  const link = el('a', { class: 'tool-file', href: '#', text: `${file.name} (${file.bytes} bytes)` });
  link.addEventListener('click', async (event) => {
    event.preventDefault();
    try {
      const url = await objectUrl(convId, file);
      const a = el('a', { href: url, download: file.name.split('/').pop() });
      document.body.append(a);
      a.click();
      a.remove();
      setTimeout(() => URL.revokeObjectURL(url), 10000);
    } catch {
      link.textContent = `${file.name} (not available)`;
    }
  });
  return link;
}

export function codeStep(step, convId) {
  const d = step.details || {};
  let code = d.code;
  if (code == null) {
    try { code = JSON.parse(step.arguments).code; } catch { code = step.arguments; }
  }
  const running = step.output == null && step.error == null;
  const summary = running ? 'Running Python…' : step.error ? `Ran Python: ${step.error.split('\n')[0].slice(0, 100)}`
    : 'Ran Python';
  const pre = el('pre', { class: 'tool-code' });
  pre.innerHTML = highlightPython(code || ''); // escaped piece by piece: see highlight.js
  const output = [d.stdout, d.stderr].some((s) => s) ? el('details', { class: 'tool-output' },
    el('summary', { text: 'Output' }),
    d.stdout ? el('pre', { class: 'tool-stdout', text: d.stdout }) : null,
    d.stderr ? el('pre', { class: 'tool-stderr', text: d.stderr }) : null) : null;
  const files = (d.files || []).filter((f) => f.id);
  const plots = files.filter((f) => f.image).map((f) => plot(convId, f));
  const downloads = files.filter((f) => !f.plot).map((f) => download(convId, f));
  return el('details', { class: `tool-step code-step${step.error ? ' failed' : ''}`, dataset: { tool: step.name },
    open: plots.length > 0 },
  el('summary', { text: summary }),
  el('div', { class: 'tool-label', text: 'Code' }), pre,
  running ? el('pre', { class: 'tool-result', text: 'running…' }) : null,
  output,
  step.error ? el('pre', { class: 'tool-result', text: `error: ${step.error}` }) : null,
  plots.length ? el('div', { class: 'tool-plots' }, plots) : null,
  downloads.length ? el('div', { class: 'tool-files' }, el('span', { class: 'tool-label', text: 'Files: ' }),
    downloads) : null);
}
