// Python source as HTML with its keywords, strings, comments and numbers marked, for the code
// interpreter's steps. Every piece of the source is escaped; only the <span>s added here are HTML.
import { escapeHtml } from './markdown.js';

const KEYWORDS = new Set(('False None True and as assert async await break class continue def del elif else '
  + 'except finally for from global if import in is lambda nonlocal not or pass raise return try while with '
  + 'yield match case').split(' '));
const BUILTINS = new Set('print len range open list dict set tuple str int float sum min max abs sorted enumerate zip'
  .split(' '));
// Triple-quoted strings, plain strings, comments, numbers, names, anything else (one character).
const TOKEN = /("""[\s\S]*?(?:"""|$)|'''[\s\S]*?(?:'''|$)|[rbfuRBFU]{0,2}"(?:\\.|[^"\\\n])*"?|[rbfuRBFU]{0,2}'(?:\\.|[^'\\\n])*'?)|(#[^\n]*)|(\b\d[\d_]*(?:\.\d*)?(?:[eE][+-]?\d+)?j?\b)|([A-Za-z_]\w*)|([\s\S])/g;

export function highlightPython(source) {
  let html = '';
  for (const m of source.matchAll(TOKEN)) {
    const [text, string, comment, number, name] = m;
    const cls = string ? 'hl-str' : comment ? 'hl-com' : number ? 'hl-num'
      : name && KEYWORDS.has(name) ? 'hl-kw' : name && BUILTINS.has(name) ? 'hl-fn' : null;
    html += cls ? `<span class="${cls}">${escapeHtml(text)}</span>` : escapeHtml(text);
  }
  return html;
}
