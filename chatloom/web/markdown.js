// A small Markdown renderer for chat text, safe by construction:
// 1. every character of the source is HTML-escaped first, so no tag or attribute from the text survives;
// 2. only then are Markdown constructs turned into the few tags this file writes itself;
// 3. links are made only for http(s) URLs, which the escaping already keeps inside their quotes.

const ESCAPES = { '&': '&amp;', '<': '&lt;', '>': '&gt;', '"': '&quot;', "'": '&#39;' };

export function escapeHtml(text) {
  return String(text).replace(/[&<>"']/g, (c) => ESCAPES[c]);
}

const FENCE = /^ {0,3}(`{3,}|~{3,})\s*([\w+#.-]*).*$/;
const HEADING = /^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$/;
const RULE = /^ {0,3}([-*_])(\s*\1){2,}\s*$/;
const QUOTE = /^ {0,3}&gt;\s?/;
const BULLET = /^(\s*)([-*+])\s+(.*)$/;
const NUMBERED = /^(\s*)(\d{1,9})[.)]\s+(.*)$/;

function startsBlock(line) {
  return FENCE.test(line) || HEADING.test(line) || RULE.test(line) || QUOTE.test(line)
    || BULLET.test(line) || NUMBERED.test(line);
}

// Inline constructs of one already-escaped line run. Code spans and links are set aside as
// placeholders first, so emphasis never reaches inside them.
function inline(text) {
  const held = [];
  const hold = (html) => `\u0000${held.push(html) - 1}\u0000`;
  let s = text.replace(/(`+)([^`]|[^`][\s\S]*?[^`])\1(?!`)/g, (_, _ticks, code) => hold(`<code>${code.trim()}</code>`));
  s = s.replace(/\[([^\]\n]+)\]\((https?:\/\/[^\s()]+)\)/g, (_, label, url) => hold(link(url, emphasis(label))));
  s = s.replace(/\bhttps?:\/\/[^\s<]*[^\s<.,;:!?'")\]]/g, (url) => hold(link(url, url)));
  s = emphasis(s);
  return s.replace(/\u0000(\d+)\u0000/g, (_, i) => held[Number(i)]);
}

function link(url, label) {
  // `url` is escaped text: quotes are entities, so it cannot leave the attribute.
  return `<a href="${url}" target="_blank" rel="noopener noreferrer nofollow">${label}</a>`;
}

function emphasis(s) {
  return s
    .replace(/\*\*(?=\S)([\s\S]*?\S)\*\*/g, '<strong>$1</strong>')
    .replace(/(^|[^\w])__(?=\S)([\s\S]*?\S)__(?!\w)/g, '$1<strong>$2</strong>')
    .replace(/\*(?=[^\s*])([^*]*?[^\s*])\*|\*([^\s*])\*/g, (_, a, b) => `<em>${a ?? b}</em>`)
    .replace(/(^|[^\w])_(?=\S)([^_]*?\S)_(?!\w)/g, '$1<em>$2</em>')
    .replace(/~~(?=\S)([\s\S]*?\S)~~/g, '<del>$1</del>');
}

function codeBlock(lang, lines) {
  const label = lang ? `<span class="code-lang">${lang}</span>` : '<span class="code-lang">code</span>';
  const cls = lang ? ` class="language-${lang.replace(/[^\w-]/g, '')}"` : '';
  return `<div class="code-block"><div class="code-head">${label}<button type="button" class="copy-code">Copy</button></div>`
    + `<pre><code${cls}>${lines.join('\n')}</code></pre></div>`;
}

// A list: consecutive items of one kind; deeper-indented items become a nested list.
function list(lines, start) {
  const first = BULLET.exec(lines[start]) || NUMBERED.exec(lines[start]);
  const ordered = !BULLET.test(lines[start]);
  const indent = first[1].length;
  const items = [];
  let i = start;
  while (i < lines.length) {
    const m = (ordered ? NUMBERED : BULLET).exec(lines[i]);
    if (m && m[1].length === indent) {
      items.push({ text: [m[3]], sub: [] });
      i += 1;
    } else if (items.length && lines[i].trim() && (/^\s/.test(lines[i]) && lines[i].search(/\S/) > indent)) {
      const item = items[items.length - 1];
      if (BULLET.test(lines[i]) || NUMBERED.test(lines[i]) || item.sub.length) item.sub.push(lines[i]);
      else item.text.push(lines[i].trim());
      i += 1;
    } else {
      break;
    }
  }
  const tag = ordered ? 'ol' : 'ul';
  const startAttr = ordered && first[2] !== '1' ? ` start="${Number(first[2])}"` : '';
  const body = items.map((it) => `<li>${it.text.map(inline).join('<br>')}${it.sub.length ? blocks(it.sub) : ''}</li>`);
  return { html: `<${tag}${startAttr}>${body.join('')}</${tag}>`, next: i };
}

// Block structure of escaped lines.
function blocks(lines) {
  const out = [];
  let i = 0;
  while (i < lines.length) {
    const line = lines[i];
    const fence = FENCE.exec(line);
    if (fence) {
      // An unclosed fence (an answer still streaming) runs to the end.
      const code = [];
      i += 1;
      while (i < lines.length && !new RegExp(`^ {0,3}${fence[1][0]}{${fence[1].length},}\\s*$`).test(lines[i])) {
        code.push(lines[i]);
        i += 1;
      }
      out.push(codeBlock(fence[2], code));
      i += 1;
      continue;
    }
    if (!line.trim()) { i += 1; continue; }
    const heading = HEADING.exec(line);
    if (heading) {
      const level = heading[1].length;
      out.push(`<h${level}>${inline(heading[2])}</h${level}>`);
      i += 1;
      continue;
    }
    if (RULE.test(line)) { out.push('<hr>'); i += 1; continue; }
    if (QUOTE.test(line)) {
      const quoted = [];
      while (i < lines.length && QUOTE.test(lines[i])) quoted.push(lines[i++].replace(QUOTE, ''));
      out.push(`<blockquote>${blocks(quoted)}</blockquote>`);
      continue;
    }
    if (BULLET.test(line) || NUMBERED.test(line)) {
      const { html, next } = list(lines, i);
      out.push(html);
      i = next;
      continue;
    }
    const para = [];
    while (i < lines.length && lines[i].trim() && (!para.length || !startsBlock(lines[i]))) para.push(lines[i++].trim());
    out.push(`<p>${para.map(inline).join('<br>')}</p>`);
  }
  return out.join('');
}

export function renderMarkdown(source) {
  const text = escapeHtml(String(source ?? '').replace(/\u0000/g, '').replace(/\r\n?/g, '\n'));
  return blocks(text.split('\n'));
}
