// Live dashboard: polls the status API every 2 s and grows the plots as steps finish.
"use strict";

const PHASE_COLORS = { eval: "#8e24aa", generate: "#1e88e5", train: "#43a047", sync: "#fb8c00",
                       checkpoint: "#6d4c41", offload: "#90a4ae" };
const CHARTS = [
  { id: "chart-reward", series: [["reward_mean", "train", "#1e88e5"], ["eval_reward_mean", "eval", "#e53935"]] },
  { id: "chart-kl", series: [["kl", "kl", "#8e24aa"]] },
  { id: "chart-loss", series: [["loss", "loss", "#43a047"]] },
  { id: "chart-entropy", series: [["entropy", "entropy", "#fb8c00"]] },
  { id: "chart-response-len", series: [["response_len_mean", "mean length", "#00897b"]] },
  { id: "chart-tokens-per-s", series: [["tokens_per_s", "tokens/s", "#3949ab"]] },
  // The engine/trainer mismatch on the sampled tokens: mean |log p_old - log p_engine|, and the k3
  // estimate of KL(engine || trainer) (rho - log rho - 1, rho = p_old / p_engine).
  { id: "chart-mismatch", series: [["logprob_mismatch", "mismatch", "#6d4c41"], ["rollout_k3", "KL k3", "#8e24aa"]] },
  // Weight sync: bytes handed to the engines (MiB), their rate, the step's sync seconds.
  { id: "chart-sync", series: [["sync_gbps", "GB/s", "#fb8c00"], ["time_sync_s", "seconds", "#6d4c41"]] },
  { id: "chart-sync-bytes", scale: 2 ** -20, series: [["sync_bytes", "MiB", "#fb8c00"]] },
  // Algorithm options (algorithm.*): empty until the option that fills them is on.
  { id: "chart-sampling", series: [["filtered_groups", "filtered groups", "#e53935"],
                                   ["sampling_rounds", "sampling rounds", "#1e88e5"]] },
  { id: "chart-truncation", series: [["truncated_fraction", "hit max_new_tokens (no EOS/stop)", "#fb8c00"],
                                     ["overlong_penalty_mean", "overlong penalty", "#8e24aa"]] },
  { id: "chart-policy", series: [["clip_fraction", "tokens clipped", "#e53935"],
                                 ["seq_clip_fraction", "responses clipped (gspo, luspo)", "#fb8c00"],
                                 ["vespo_phi_mean", "VESPO phi mean", "#3949ab"]] },
  // algorithm.corrections: the importance weights' mean, tokens truncated, tokens and responses masked;
  // rollout.routing_replay: the share of (token, MoE layer) pairs the trainer would have routed elsewhere.
  { id: "chart-tis", series: [["tis_weight_mean", "IS weight mean", "#00897b"],
                              ["tis_clipped_fraction", "tokens truncated", "#e53935"],
                              ["masked_token_fraction", "tokens masked", "#8e24aa"],
                              ["masked_sequence_fraction", "responses masked", "#fb8c00"],
                              ["routing_mismatch_fraction", "routes replayed that differ", "#3949ab"]] },
  // rollout.generate_function (multi-turn, tools), rollout.max_staleness and rollout.partial_rollouts.
  { id: "chart-tools", series: [["turns_mean", "turns", "#1e88e5"], ["tool_calls_mean", "tool calls", "#43a047"],
                                ["tool_errors", "tool errors", "#e53935"],
                                ["policy_tokens_fraction", "policy token fraction", "#8e24aa"]] },
  { id: "chart-staleness", series: [["staleness_mean", "staleness (weight versions)", "#6d4c41"]] },
  // rollout.partial_rollouts: samples aborted and carried into the next step, and how old the
  // trained samples' oldest tokens are.
  { id: "chart-partial", series: [["partial_samples_carried", "samples carried", "#1e88e5"],
                                  ["partial_age_mean", "age mean (versions)", "#6d4c41"],
                                  ["partial_age_max", "age max (versions)", "#e53935"],
                                  ["partial_tokens_discarded", "tokens discarded", "#8e24aa"]] },
  // Colocated hand-off: what each side holds per phase (device memory on GPU, process RSS on CPU), MiB.
  { id: "chart-memory", scale: 2 ** -20, series: [
    ["memory_engine_serving_bytes", "engine generating", "#1e88e5"],
    ["memory_engine_released_bytes", "engine released", "#90caf9"],
    ["memory_trainer_awake_bytes", "trainer training", "#43a047"],
    ["memory_trainer_asleep_bytes", "trainer asleep", "#a5d6a7"]] },
];

// Beyond loopback the API wants the run's token: open the dashboard as .../#token=TOKEN (a fragment
// never leaves the browser).
const TOKEN = new URLSearchParams(location.hash.slice(1)).get("token");
const HEADERS = TOKEN ? { Authorization: `Bearer ${TOKEN}` } : {};
const getJSON = url => fetch(url, { headers: HEADERS }).then(r => {
  if (!r.ok) throw new Error(`${url}: HTTP ${r.status}`);
  return r.json();
});

const rows = [];
const plots = {};

function fmtSeconds(s) {
  if (s === null || s === undefined) return "–";
  if (s < 90) return `${s.toFixed(0)} s`;
  if (s < 5400) return `${(s / 60).toFixed(1)} min`;
  return `${(s / 3600).toFixed(1)} h`;
}

function fmtTick(v) {
  if (v === null) return "";
  const a = Math.abs(v);
  if (a !== 0 && (a < 1e-3 || a >= 1e5)) return v.toExponential(1);
  return String(+v.toPrecision(3));
}

function yRange(min, max) {
  if (min === null || max === null) return [0, 1];
  if (min === max) {
    const pad = min === 0 ? 1 : Math.abs(min) * 0.1;
    return [min - pad, max + pad];
  }
  const pad = (max - min) * 0.08;
  return [min - pad, max + pad];
}

// A chart has data once any of its series has a value: a feature that is off (dynamic sampling,
// TIS, tools, staleness, partial rollouts) leaves its chart empty, and an empty chart is hidden.
function hasData(chart) {
  return chart.series.some(([key]) => rows.some(r => r[key] !== undefined && r[key] !== null));
}

function chartData(chart) {
  const xs = rows.map(r => r.step);
  const scale = chart.scale || 1;
  return [xs, ...chart.series.map(([key]) => rows.map(r => (r[key] === undefined || r[key] === null ? null
                                                                                    : r[key] * scale)))];
}

// A legend value. At the latest step (where the legend rests) a series without a value there, an
// eval between its intervals, shows its latest value and that value's step instead of "–".
function legendValue(u, v, seriesIdx, idx) {
  if (v !== null && v !== undefined) return fmtTick(v);
  const values = u.data[seriesIdx];
  if (idx === null || idx !== values.length - 1) return "–";
  for (let i = values.length - 1; i >= 0; i--) {
    if (values[i] !== null && values[i] !== undefined) return `${fmtTick(values[i])} (step ${u.data[0][i]})`;
  }
  return "–";
}

function ensurePlots() {
  for (const chart of CHARTS) {
    if (plots[chart.id]) continue;
    const el = document.getElementById(chart.id);
    const title = document.createElement("h3");
    title.textContent = el.dataset.title;
    el.appendChild(title);
    plots[chart.id] = new uPlot({
      width: Math.max(el.clientWidth - 12, 300), height: 190,
      // A flat series (KL 0 without a KL term, no clipping) gets a narrow axis around its value,
      // not uPlot's default 0..100 for a constant.
      scales: { x: { time: false }, y: { range: (u, min, max) => yRange(min, max) } },
      series: [{ label: "step" }, ...chart.series.map(([, label, color]) => ({ label, stroke: color, spanGaps: true,
               points: { show: true, size: 3 }, value: legendValue }))],
      axes: [{ label: "step" }, { size: 60, values: (u, ticks) => ticks.map(fmtTick) }],
    }, chartData(chart), el);
  }
}

// eval.datasets: one chart per named eval set (its metrics are eval_NAME_*), added when its first
// eval arrives: mean reward (pass@1 over its n answers), each pass@k, the share of answers truncated.
const EVAL_SET_COLORS = ["#e53935", "#1e88e5", "#43a047", "#8e24aa", "#fb8c00", "#00897b"];

function addEvalSetCharts() {
  const names = new Set();
  for (const r of rows) {
    for (const key of Object.keys(r)) {
      const m = /^eval_([a-z][a-z0-9_]*)_reward_mean$/.exec(key);
      if (m) names.add(m[1]);
    }
  }
  for (const name of names) {
    const id = `chart-eval-${name}`;
    const passKeys = new Set();
    for (const r of rows) {
      for (const key of Object.keys(r)) if (key.startsWith(`eval_${name}_pass_at_`)) passKeys.add(key);
    }
    const ks = [...passKeys].sort((a, b) => Number(a.split("_").pop()) - Number(b.split("_").pop()));
    const keys = [[`eval_${name}_reward_mean`, "reward mean (pass@1)"],
                  ...ks.map(key => [key, `pass@${key.split("_").pop()}`]),
                  [`eval_${name}_truncated_fraction`, "hit max_new_tokens"]];
    const series = keys.map(([key, label], i) => [key, label, EVAL_SET_COLORS[i % EVAL_SET_COLORS.length]]);
    const known = CHARTS.find(c => c.id === id);
    if (known && known.series.length === series.length) continue;
    if (known) {  // a pass@k that arrived later: the chart is built again with it
      plots[id].destroy();
      delete plots[id];
      document.getElementById(id).replaceChildren();
      known.series = series;
      continue;
    }
    const el = document.createElement("div");
    el.className = "chart";
    el.id = id;
    el.dataset.title = `eval set ${name}`;
    el.dataset.evalSet = name;
    // next to the reward chart (after the sets already shown), where a reader looks for evals
    const evalCharts = document.querySelectorAll("section.charts [data-eval-set]");
    (evalCharts.length ? evalCharts[evalCharts.length - 1] : document.getElementById("chart-reward")).after(el);
    CHARTS.push({ id, series });
  }
}

// rollout.max_staleness=N: the staleness chart also draws the share of samples 0..N versions behind
// (staleness_0 .. staleness_N), once they arrive.
function addStalenessShares() {
  const chart = CHARTS.find(c => c.id === "chart-staleness");
  const last = rows[rows.length - 1] || {};
  const shares = Object.keys(last).filter(k => /^staleness_\d+$/.test(k))
    .sort((a, b) => Number(a.split("_")[1]) - Number(b.split("_")[1]));
  if (!shares.length || chart.series.length === shares.length + 1 || !plots[chart.id]) return;
  chart.series = [chart.series[0], ...shares.map((key, i) => [key, `share ${key.split("_")[1]} behind`,
                                                              EVAL_SET_COLORS[(i + 1) % EVAL_SET_COLORS.length]])];
  plots[chart.id].destroy();
  delete plots[chart.id];
  document.getElementById(chart.id).replaceChildren();
}

function redrawPlots() {
  addEvalSetCharts();
  addStalenessShares();
  ensurePlots();
  const off = [];
  for (const chart of CHARTS) {
    const el = document.getElementById(chart.id);
    const shown = hasData(chart);
    if (shown && el.hidden) {  // a feature's first values: drawn at the width it now has
      el.hidden = false;
      plots[chart.id].setSize({ width: Math.max(el.clientWidth - 12, 300), height: 190 });
    }
    el.hidden = !shown;
    if (!shown) off.push(el.dataset.title);
    const plot = plots[chart.id];
    plot.setData(chartData(chart));
    // the legend shows the latest step's values until the cursor points elsewhere
    if (rows.length) plot.setLegend({ idx: rows.length - 1 });
    el.dataset.yRange = `${plot.scales.y.min},${plot.scales.y.max}`;  // drawn on a canvas: here for readers
    // One point per finished step: exposed for tests and for people reading the DOM.
    el.dataset.points = String(rows.length);
  }
  const note = document.getElementById("charts-off");
  note.hidden = !off.length;
  note.textContent = off.length ? `Not shown, no data in this run (the feature is off): ${off.join("; ")}.` : "";
}

function redrawTimeline() {
  const legend = document.getElementById("timeline-legend");
  if (!legend.childElementCount) {
    for (const [phase, color] of Object.entries(PHASE_COLORS)) {
      legend.insertAdjacentHTML("beforeend", `<span class="legend-item"><i style="background:${color}"></i>${phase}</span>`);
    }
  }
  if (rows.some(r => r.prefetch_s > 0) && !legend.querySelector('[data-legend="next-batch"]')) {
    legend.insertAdjacentHTML("beforeend", `<span class="legend-item" data-legend="next-batch"><i style="background:` +
      `${PHASE_COLORS.generate};opacity:0.55"></i>next batch, generated meanwhile (rollout.max_staleness)</span>`);
  }
  const recent = rows.slice(-60);
  const byStep = new Map(rows.map(r => [r.step, r]));
  const longest = Math.max(...recent.map(r => r.time_step_s || 0), 1e-9);
  const box = document.getElementById("timeline");
  box.innerHTML = "";
  let restartsBefore = rows.length > recent.length ? rows[rows.length - recent.length - 1].engine_restarts || 0 : 0;
  for (const r of recent) {
    const restarted = (r.engine_restarts || 0) > restartsBefore;
    restartsBefore = r.engine_restarts || restartsBefore;
    const segments = Object.entries(PHASE_COLORS).filter(([p]) => r[`time_${p}_s`] > 0).map(([p, color]) => {
      const seconds = r[`time_${p}_s`];
      const width = Math.max((seconds / longest) * 600, 1);
      return `<div class="tl-seg" data-phase="${p}" title="${p}: ${seconds.toFixed(3)} s" style="width:${width}px;background:${color}"></div>`;
    }).join("");
    // rollout.max_staleness=1: the next step's batch generates while this one trains; a second
    // lane shows when it ran, on the same time scale (the next step's row carries its times).
    const next = byStep.get(r.step + 1);
    const overlap = next && next.prefetch_s > 0 ? `<div class="tl-bar tl-lane"><div class="tl-seg" data-phase="next-batch" ` +
      `title="next step's batch, generated during this step: ${next.prefetch_s.toFixed(3)} s" style="margin-left:` +
      `${(next.prefetch_start_s / longest) * 600}px;width:${Math.max((next.prefetch_s / longest) * 600, 1)}px;` +
      `background:${PHASE_COLORS.generate};opacity:0.55"></div></div>` : "";
    // Newest first: the box scrolls, and opens on the step that just finished.
    box.insertAdjacentHTML("afterbegin",
      `<div class="tl-row${overlap ? " tl-overlapped" : ""}" data-step="${r.step}"><span class="tl-step">${r.step}</span>` +
      `<div class="tl-lanes"><div class="tl-bar">${segments}</div>${overlap}</div>` +
      `<span style="margin-left:6px">${(r.time_step_s || 0).toFixed(2)} s</span>` +
      (restarted ? `<span class="tl-event" data-event="engine-restart">engine restarted</span>` : "") + `</div>`);
  }
  box.dataset.steps = String(recent.length);
}

function cell(text, className) {
  const td = document.createElement("td");
  td.textContent = text;  // server strings (Ray errors, paths) are text, never markup
  if (className) td.className = className;
  return td;
}

const ENDED = new Set(["finished", "stopped"]);

function redrawActors(actors, state) {
  const body = document.querySelector("#actors tbody");
  const now = Date.now() / 1000;
  body.replaceChildren(...actors.map(a => {
    const tr = document.createElement("tr");
    tr.dataset.kind = a.kind;
    // a run that ended well stopped its actors: that is no failure
    const alive = a.alive ? cell("yes", "alive") : ENDED.has(state) ? cell(`stopped (run ${state})`, "ended")
                                                                     : cell("no", "dead");
    tr.append(cell(a.name), cell(a.kind), alive,
              cell(a.last_heartbeat ? fmtSeconds(now - a.last_heartbeat) + " ago" : "–"),
              cell(a.memory_bytes ? (a.memory_bytes / 2 ** 20).toFixed(0) + " MiB" : "–"), cell(a.detail || ""));
    return tr;
  }));
}

function redrawStatus(s) {
  document.getElementById("run-id").textContent = s.run_id;
  const badge = document.getElementById("state");
  badge.textContent = s.paused && s.state !== "paused" ? `${s.state} (pausing)` : s.state;
  badge.className = `badge ${s.state}`;
  document.getElementById("step").textContent = s.step;
  document.getElementById("total-steps").textContent = s.total_steps;
  document.getElementById("weight-version").textContent = s.weight_version;
  document.getElementById("eta").textContent = fmtSeconds(s.eta_seconds);
  const last = s.last_metrics || {};
  document.getElementById("tps").textContent = last.tokens_per_s ? last.tokens_per_s.toFixed(0) : "–";
  const fmt = v => (v === undefined || v === null ? "–" : (+v.toPrecision(3)).toString());
  document.getElementById("reward").textContent = fmt(last.reward_mean);
  const evals = rows.filter(r => r.eval_reward_mean !== undefined && r.eval_reward_mean !== null);
  document.getElementById("eval-reward").textContent = evals.length ? fmt(evals[evals.length - 1].eval_reward_mean) : "–";
  const error = document.getElementById("error");
  error.hidden = !s.error;
  error.textContent = s.error || "";
  const hang = document.getElementById("latest-hang");
  hang.hidden = !s.latest_hang;
  document.getElementById("latest-hang-dir").textContent = s.latest_hang || "";
}

// The latest answers, newest first (the API gives them oldest first); text only, never markup.
function redrawSamples(samples) {
  const body = document.querySelector("#samples tbody");
  body.replaceChildren(...samples.slice().reverse().map(sample => {
    const tr = document.createElement("tr");
    tr.dataset.source = sample.source;
    const prompt = cell(sample.prompt, "sample-text");
    // a vision-language prompt's images: thumbnails (data: URIs of PNGs, from the API only)
    for (const uri of sample.images || []) {
      if (!uri.startsWith("data:image/png;base64,")) continue;
      const img = document.createElement("img");
      img.src = uri;
      img.className = "sample-image";
      img.alt = "prompt image";
      prompt.prepend(img);
    }
    tr.append(cell(String(sample.step)), cell(sample.source), prompt,
              cell(sample.response, "sample-text"),
              cell(sample.reward === null ? "error" : (+sample.reward.toPrecision(3)).toString()),
              cell(sample.finish_reason));
    return tr;
  }));
  document.getElementById("samples").dataset.rows = String(samples.length);
}

async function poll() {
  try {
    const next = rows.length ? rows[rows.length - 1].step + 1 : 0;
    const [status, metrics, actors, samples] = await Promise.all([
      getJSON("/api/v1/status"),
      getJSON(`/api/v1/metrics?since=${next}`),
      getJSON("/api/v1/actors"),
      getJSON("/api/v1/samples"),
    ]);
    rows.push(...metrics.rows);
    redrawStatus(status);
    redrawPlots();
    redrawTimeline();
    redrawActors(actors.actors, status.state);
    redrawSamples(samples.samples);
    document.body.dataset.loaded = "true";
  } catch (err) {
    document.getElementById("state").textContent = "disconnected";
  }
}

poll();
setInterval(poll, 2000);
