// The quota box in the sidebar, from GET /usage: today's tokens against the tier's daily limit,
// and what is left this minute. A server without /usage (404) simply shows no box.
import { el } from './dom.js';

// 950, 12,000, 200k, 1.5M, 20M: never "20000k".
export const fmt = (n) => {
  if (n >= 1e6) return `${Number((n / 1e6).toFixed(n >= 1e7 ? 0 : 1))}M`;
  if (n >= 1e5) return `${Math.round(n / 1e3)}k`;
  return Number(n).toLocaleString('en-US');
};
const today = () => new Date().toISOString().slice(0, 10); // the server counts UTC days

export function renderUsage(box, usage) {
  if (!usage || !Array.isArray(usage.data)) { box.hidden = true; return; }
  const used = usage.data.filter((row) => row.day === today()).reduce((sum, row) => sum + (row.total_tokens || 0), 0);
  const daily = usage.limits?.tokens_per_day || null;
  const lines = [
    el('strong', { text: usage.tier ? `${usage.tier[0].toUpperCase()}${usage.tier.slice(1)} plan` : 'Usage' }),
    el('div', { class: 'usage-line', text: `Today: ${fmt(used)}${daily ? ` / ${fmt(daily)}` : ''} tokens` }),
  ];
  if (daily) {
    const fill = el('span');
    fill.style.width = `${Math.min(100, (100 * used) / daily).toFixed(1)}%`;
    lines.push(el('div', { class: 'bar', role: 'progressbar', 'aria-valuenow': used, 'aria-valuemax': daily }, fill));
  }
  if (usage.limits?.tokens_per_minute && usage.remaining_tokens_this_minute != null) {
    lines.push(el('div', { class: 'muted', text: `${fmt(usage.remaining_tokens_this_minute)} tokens left this minute` }));
  }
  box.replaceChildren(...lines);
  box.hidden = false;
}
