// Images and voice in the composer. Images pasted, dropped or chosen, for a model that reads them, wait
// as thumbnails above the box and go with the next message as data URLs; a sent message's images show
// in its bubble, fetched with the session's token (an <img src> could not send it). The microphone
// records with MediaRecorder, sends the recording to /v1/audio/transcriptions and puts the text in the box.
import { ApiError, request, session } from './api.js';
import { $, el } from './dom.js';

const IMAGE_TYPES = ['image/png', 'image/jpeg', 'image/webp', 'image/gif', 'image/bmp'];
const pending = []; // { name, url } of the images the next message carries

export function isImage(file) { return IMAGE_TYPES.includes(file.type); }

function dataUrl(file) {
  return new Promise((resolve, reject) => {
    const reader = new FileReader();
    reader.onload = () => resolve(reader.result);
    reader.onerror = () => reject(reader.error);
    reader.readAsDataURL(file);
  });
}

export async function addImages(files) {
  for (const file of files) pending.push({ name: file.name || 'image', url: await dataUrl(file) });
  renderTray();
}

// The waiting images' data URLs, and the tray emptied (once the message is on its way).
export function pendingImages() { return pending.map((p) => p.url); }
export function clearImages() { pending.length = 0; renderTray(); }

function renderTray() {
  const tray = $('image-tray');
  tray.replaceChildren(...pending.map((p, i) => el('span', { class: 'thumb' },
    el('img', { src: p.url, alt: p.name }),
    el('button', { type: 'button', class: 'remove-image', 'aria-label': `Remove ${p.name}`,
      onclick: () => { pending.splice(i, 1); renderTray(); } }, '×'))));
  tray.hidden = pending.length === 0;
}

// A message's stored images (file ids) as thumbnails.
export function messageImages(ids) {
  if (!ids?.length) return null;
  return el('div', { class: 'message-images' }, ids.map((id) => {
    const img = el('img', { class: 'message-image', alt: 'image' });
    request('GET', `/v1/files/${encodeURIComponent(id)}/content`, { raw: true })
      .then((res) => res.blob())
      .then((blob) => { img.src = URL.createObjectURL(blob); }, () => { img.alt = 'image (not available)'; });
    return img;
  }));
}

async function transcribe(blob) {
  const form = new FormData();
  form.append('file', blob, blob.type.includes('ogg') ? 'recording.ogg' : 'recording.webm');
  form.append('model', 'whisper-1');
  const headers = session.token ? { Authorization: `Bearer ${session.token}` } : {};
  const res = await fetch('/v1/audio/transcriptions', { method: 'POST', headers, body: form });
  const body = await res.json().catch(() => ({}));
  if (!res.ok) throw new ApiError(res.status, body?.error?.message || `${res.status} ${res.statusText}`);
  return body.text || '';
}

// hooks: { notice(message), onText(text) }
export function setupMicrophone(hooks) {
  const button = $('mic');
  let recorder = null;
  button.addEventListener('click', async () => {
    if (recorder) { recorder.stop(); return; }
    let stream;
    try {
      stream = await navigator.mediaDevices.getUserMedia({ audio: true });
    } catch (err) {
      hooks.notice(`The microphone is not available: ${err.message || err.name}`);
      return;
    }
    const chunks = [];
    recorder = new MediaRecorder(stream);
    recorder.addEventListener('dataavailable', (e) => { if (e.data.size) chunks.push(e.data); });
    recorder.addEventListener('stop', async () => {
      stream.getTracks().forEach((t) => t.stop());
      const blob = new Blob(chunks, { type: recorder.mimeType || 'audio/webm' });
      recorder = null;
      button.classList.remove('recording');
      button.setAttribute('aria-pressed', 'false');
      button.disabled = true;
      try {
        hooks.onText(await transcribe(blob));
      } catch (err) {
        hooks.notice(`Transcription failed: ${err.message}`);
      } finally {
        button.disabled = false;
      }
    });
    recorder.start();
    button.classList.add('recording');
    button.setAttribute('aria-pressed', 'true');
  });
}
