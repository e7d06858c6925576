// Small line icons drawn as inline SVG, so they look the same whatever fonts the system has.
const PATHS = {
  edit: 'M4 20h4L19 9l-4-4L4 16v4zM14 6l4 4',
  trash: 'M4 7h16M9 7V4h6v3M6 7l1 13h10l1-13M10 11v6M14 11v6',
  copy: 'M9 9h11v11H9zM5 15H4V4h11v1',
  regenerate: 'M20 11a8 8 0 1 0-2.3 5.7M20 4v7h-7',
  up: 'M7 11v9H4v-9h3zm0 0 4-7a2 2 0 0 1 3 2l-1 4h6a2 2 0 0 1 2 2.3l-1.3 6A2 2 0 0 1 17.7 20H7',
  down: 'M7 13V4H4v9h3zm0 0 4 7a2 2 0 0 0 3-2l-1-4h6a2 2 0 0 0 2-2.3l-1.3-6A2 2 0 0 0 17.7 4H7',
  menu: 'M4 6h16M4 12h16M4 18h16',
  share: 'M4 13v7h16v-7M12 3v12M7 8l5-5 5 5',
};

export function icon(name) {
  const ns = 'http://www.w3.org/2000/svg';
  const svg = document.createElementNS(ns, 'svg');
  svg.setAttribute('viewBox', '0 0 24 24');
  svg.setAttribute('class', 'icon-svg');
  svg.setAttribute('aria-hidden', 'true');
  const path = document.createElementNS(ns, 'path');
  path.setAttribute('d', PATHS[name]);
  svg.append(path);
  return svg;
}
