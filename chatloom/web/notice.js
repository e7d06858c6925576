// The notice bar above the composer: plain-language errors, with a countdown and a Retry button
// for "come back later" answers (429 quota / rate limits, 503 busy or loading).
import { $ } from './dom.js';

let timer = null;

// A server message as a sentence: "quota used" -> "quota used."
const sentence = (text) => (/[.!?…]$/.test(text.trim()) ? text.trim() : `${text.trim()}.`);

// A message that already says a limit was reached is not prefixed again ("Usage limit reached: rate limit reached").
const saysLimitReached = (text) => /\b(limit|quota)\b/i.test(text) && /\b(reached|used up|exceeded)\b/i.test(text);
const capital = (text) => text.charAt(0).toUpperCase() + text.slice(1);

export function describeError(err) {
  const message = sentence(err?.message || String(err));
  if (err?.status === 429) return saysLimitReached(message) ? capital(message) : `Usage limit reached: ${message}`;
  if (err?.status === 503) return `The server is busy: ${message}`;
  return message;
}

export function hideNotice() {
  clearInterval(timer);
  timer = null;
  $('notice').hidden = true;
}

// Show `text`; with retryAfter (seconds) count down to zero before Retry is enabled.
export function showNotice(text, { retryAfter = null, onRetry = null } = {}) {
  hideNotice();
  const box = $('notice');
  const label = $('notice-text');
  const retry = $('notice-retry');
  box.hidden = false;
  box.dataset.kind = onRetry ? 'retry' : 'info';
  retry.hidden = !onRetry;
  retry.onclick = onRetry ? () => { hideNotice(); onRetry(); } : null;
  let left = retryAfter ?? 0;
  const tick = () => {
    if (left > 0) {
      label.textContent = `${text} Try again in ${left} s.`;
      retry.disabled = true;
    } else {
      label.textContent = onRetry && retryAfter != null ? `${text} You can try again now.` : text;
      retry.disabled = false;
      clearInterval(timer);
      timer = null;
    }
    left -= 1;
  };
  tick();
  if (left >= 0 && retryAfter) timer = setInterval(tick, 1000);
}

export function setupNotice() {
  $('notice-close').addEventListener('click', hideNotice);
}
