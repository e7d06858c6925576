// Server-sent events over fetch: EventSource cannot POST or send an Authorization header,
// so the app reads the response body itself and splits it into events.

// One event block ("id: 3\nevent: error\ndata: {...}") as {id, event, data}; null for comments.
export function parseBlock(block) {
  let id = null;
  let event = null;
  const data = [];
  for (const line of block.split('\n')) {
    if (!line || line.startsWith(':')) continue;
    const colon = line.indexOf(':');
    const field = colon < 0 ? line : line.slice(0, colon);
    let value = colon < 0 ? '' : line.slice(colon + 1);
    if (value.startsWith(' ')) value = value.slice(1);
    if (field === 'id') id = value;
    else if (field === 'event') event = value;
    else if (field === 'data') data.push(value);
  }
  if (!data.length) return null;
  const raw = data.join('\n');
  let parsed = raw;
  try { parsed = JSON.parse(raw); } catch { /* plain text data */ }
  return { id, event, data: parsed };
}

// Yield the events of a fetch Response as they arrive. Breaking out of the loop cancels the body.
export async function* readEvents(response) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = '';
  try {
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buffer += decoder.decode(value, { stream: true }).replace(/\r\n?/g, '\n');
      let cut;
      while ((cut = buffer.indexOf('\n\n')) >= 0) {
        const event = parseBlock(buffer.slice(0, cut));
        buffer = buffer.slice(cut + 2);
        if (event) yield event;
      }
    }
    const last = parseBlock(buffer.trim());
    if (last) yield last;
  } finally {
    reader.cancel().catch(() => {});
  }
}
