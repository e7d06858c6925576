// el('button', {class: 'x', onclick: fn, text: 'Go'}, child...): a small element builder.
// Children that are strings become text nodes, never HTML.
export function el(tag, props = {}, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(props)) {
    if (value == null || value === false) continue;
    if (key === 'class') node.className = value;
    else if (key === 'text') node.textContent = value;
    else if (key === 'dataset') Object.assign(node.dataset, value);
    else if (key.startsWith('on') && typeof value === 'function') node.addEventListener(key.slice(2), value);
    else node.setAttribute(key, value === true ? '' : String(value));
  }
  for (const child of children.flat()) if (child != null && child !== false) node.append(child);
  return node;
}

export const $ = (id) => document.getElementById(id);

// True when the element is scrolled (nearly) to its bottom, so streaming may keep it there.
export function nearBottom(node, slack = 80) {
  return node.scrollHeight - node.scrollTop - node.clientHeight < slack;
}

// Ask before a destructive act: `box`'s contents become "question Yes No" until one is chosen.
// Focus lands on No, so a keyboard user's next Enter does nothing for good by accident.
export function askFirst(box, question, onYes) {
  const before = [...box.childNodes];
  const no = el('button', { type: 'button', class: 'link no', text: 'No',
    onclick: () => box.replaceChildren(...before) });
  box.replaceChildren(el('span', { class: 'muted', text: question }),
    el('button', { type: 'button', class: 'link danger yes', text: 'Yes', onclick: onYes }), no);
  no.focus();
}
