// The Operations page (admins): polls GET /admin/ops every 2 s and draws the last minutes as charts
// (uPlot, vendored under vendor/uplot/), with tables of the replicas, goodput per class and today's
// usage per tier. Each chart's figure carries data-points, the number of snapshots it holds.
import { request, session } from './api.js';
import { $, el } from './dom.js';
import { fmt } from './usage.js';
import uPlot from './vendor/uplot/uPlot.esm.js';

const POLL_MS = 2000;
const KEEP = 300; // snapshots kept: ten minutes at one every 2 s
const COLORS = ['#10a37f', '#3b82f6', '#d97706', '#d03a3a', '#8b5cf6', '#0891b2', '#db2777', '#65a30d'];

// Axis text and grid in the page's own colours, so dark mode stays readable.
const css = (name) => getComputedStyle(document.documentElement).getPropertyValue(name).trim();
const ink = () => css('--muted') || '#6b7280';
const line = () => css('--border') || '#e3e4e8';

const history = []; // { t, snapshot, arrivalsPerS }
let timer = null;

// -- charts -----------------------------------------------------------------------------

// A uPlot chart whose series may change (a new traffic class appears): rebuilt when the names do.
class Chart {
  constructor(figureId, yLabel, range = null) {
    this.figure = $(figureId);
    this.yLabel = yLabel;
    this.range = range;
    this.names = null;
    this.plot = null;
  }

  width() { return Math.max(280, this.figure.clientWidth - 16); }

  update(xs, series) {
    const names = series.map((s) => s.name);
    if (!this.plot || names.join('\u0000') !== this.names.join('\u0000')) {
      this.plot?.destroy();
      this.names = names;
      this.plot = new uPlot({
        width: this.width(), height: 200,
        scales: { x: { time: true }, y: this.range ? { range: this.range } : { auto: true } },
        axes: [{ stroke: ink(), grid: { stroke: line() }, ticks: { stroke: line() } },
          { label: this.yLabel, size: 60, stroke: ink(), grid: { stroke: line() }, ticks: { stroke: line() } }],
        series: [{}, ...series.map((s, i) => ({ label: s.name, stroke: COLORS[i % COLORS.length], width: 2,
          scale: 'y', spanGaps: false }))],
      }, [xs, ...series.map((s) => s.values)], this.figure);
    } else {
      this.plot.setData([xs, ...series.map((s) => s.values)]);
    }
    this.figure.dataset.points = String(xs.length);
  }

  resize() { this.plot?.setSize({ width: this.width(), height: 200 }); }
}

const charts = {
  queue: new Chart('chart-queue', 'requests, s'),
  kv: new Chart('chart-kv', 'share', (_u, _min, max) => [0, Math.max(1, max)]),
  goodput: new Chart('chart-goodput', 'share', () => [0, 1]),
  arrivals: new Chart('chart-arrivals', 'requests/s'),
  replicas: new Chart('chart-replicas', 'replicas'),
};

const col = (f) => history.map((h) => { const v = f(h.snapshot, h); return v == null ? null : v; });

function replicaCounts(s) {
  if (!s.replicas.length) return { ready: s.ready ? 1 : 0, draining: 0, ejected: 0, inflight: s.queue.running };
  const count = (state) => s.replicas.filter((r) => r.state === state).length;
  return { ready: count('ready'), draining: count('draining'), ejected: count('ejected'),
    inflight: s.replicas.reduce((sum, r) => sum + r.inflight, 0) };
}

function drawCharts() {
  const xs = history.map((h) => h.t);
  charts.queue.update(xs, [
    { name: 'waiting', values: col((s) => s.queue.waiting) },
    { name: 'running', values: col((s) => s.queue.running) },
    { name: 'wait (s, last seconds)', values: col((s) => s.queue.recent_wait_s) },
  ]);
  const kv = [{ name: 'overall', values: col((s) => s.kv_cache_usage) }];
  const urls = [...new Set(history.flatMap((h) => h.snapshot.replicas.map((r) => r.url)))];
  for (const url of urls) {
    kv.push({ name: url, values: col((s) => s.replicas.find((r) => r.url === url)?.kv_cache_usage ?? null) });
  }
  charts.kv.update(xs, kv);
  const classes = [...new Set(history.flatMap((h) => h.snapshot.classes.map((c) => c.name)))].sort();
  charts.goodput.update(xs, classes.map((name) => ({
    name, values: col((s) => s.classes.find((c) => c.name === name)?.goodput_share ?? null) })));
  const arrivals = [{ name: 'arrivals', values: col((_s, h) => h.arrivalsPerS) }];
  if (history.some((h) => h.snapshot.autoscale.enabled)) {
    arrivals.push({ name: 'forecast', values: col((s) => s.autoscale.forecast_rps) });
  }
  charts.arrivals.update(xs, arrivals);
  const replicas = [
    { name: 'ready', values: col((s) => replicaCounts(s).ready) },
    { name: 'draining', values: col((s) => replicaCounts(s).draining) },
    { name: 'ejected', values: col((s) => replicaCounts(s).ejected) },
    { name: 'in flight', values: col((s) => replicaCounts(s).inflight) },
  ];
  if (history.some((h) => h.snapshot.autoscale.enabled)) {
    replicas.push({ name: 'desired', values: col((s) => s.autoscale.desired) });
  }
  charts.replicas.update(xs, replicas);
}

// -- the figures now ------------------------------------------------------------------------

const pct = (v) => (v == null ? '–' : `${(100 * v).toFixed(0)}%`);
const secs = (v) => `${v < 10 ? v.toFixed(2) : v.toFixed(0)} s`;
const cells = (...values) => values.map((v) => el('td', { text: String(v) }));

function drawNow(s) {
  const d = s.degrade;
  $('degrade-step').textContent = !d.enabled ? 'off' : d.step ? `${d.level}/${d.steps.length}: ${d.step}` : 'none';
  $('queue-now').textContent = `${s.queue.waiting} waiting, ${s.queue.running}/${s.queue.max_running} running, `
    + `wait ${secs(Math.max(s.queue.oldest_wait_s, s.queue.recent_wait_s))} of ${secs(s.queue.max_wait_s)}`;
  $('kv-now').textContent = pct(s.kv_cache_usage);
  const a = s.autoscale;
  $('autoscale-now').textContent = !a.enabled ? 'off'
    : `${a.serving} serving, ${a.desired} desired${a.starting ? `, ${a.starting} starting` : ''}`
      + ` (${a.min_replicas}–${a.max_replicas}); forecast ${a.forecast_rps.toFixed(2)}/s`;

  const replicaRows = s.replicas.map((r) => el('tr', { dataset: { state: r.state } },
    el('td', { text: r.url }), el('td', { class: `state-${r.state}`, text: r.state, title: r.error || '' }),
    ...cells(r.inflight, r.served, pct(r.kv_cache_usage))));
  $('replicas-table').tBodies[0].replaceChildren(...(replicaRows.length ? replicaRows
    : [el('tr', {}, el('td', { colspan: 5, class: 'muted', text: 'One backend, no router.' }))]));
  $('classes-table').tBodies[0].replaceChildren(...s.classes.map((c) => el('tr', {},
    ...cells(c.name, c.requests, c.goodput_requests, pct(c.goodput_share)))));
  $('usage-day').textContent = `(${s.day}, UTC)`;
  $('tiers-table').tBodies[0].replaceChildren(...s.usage_by_tier.map((t) => el('tr', {},
    ...cells(t.tier, t.users, fmt(t.requests), fmt(t.total_tokens), fmt(t.cached_tokens)))));
}

// -- polling --------------------------------------------------------------------------------

function fail(message, link = false) {
  clearTimeout(timer);
  timer = null;
  $('ops').hidden = true;
  const box = $('ops-error');
  box.replaceChildren(message, ...(link ? [' ', el('a', { href: '/', text: 'Sign in' })] : []));
  box.hidden = false;
}

async function poll() {
  timer = null;
  try {
    const s = await request('GET', '/admin/ops');
    const last = history.at(-1);
    const dt = last ? s.time - last.snapshot.time : 0;
    history.push({ t: s.time, snapshot: s, arrivalsPerS: dt > 0 ? Math.max(0, s.arrivals - last.snapshot.arrivals) / dt : null });
    if (history.length > KEEP) history.shift();
    $('ops').hidden = false;
    $('ops-error').hidden = true;
    drawNow(s);
    drawCharts();
    $('ops-status').textContent = `updated ${new Date(s.time * 1000).toLocaleTimeString()}`;
  } catch (err) {
    if (err.status === 401) return fail('Your session has ended.', true);
    if (err.status === 403) return fail('The Operations page is for admins only.');
    $('ops-status').textContent = `no answer: ${err.message}; trying again`;
  }
  timer = setTimeout(poll, POLL_MS);
}

function main() {
  if (!session.token) return fail('Sign in as an admin to see the Operations page.', true);
  window.addEventListener('resize', () => Object.values(charts).forEach((c) => c.resize()));
  poll();
}

main();
