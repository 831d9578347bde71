"use strict";
// The page map: the GPU pool, the CPU swap pool and the prefix cache's host tier (when
// --kv-offloading-size gives it one) drawn block by block on canvases, live from the
// server-sent frames of /v1/kv/stream (one full frame, then only the blocks that changed).
// Canvases rather than one element per block, so 10,000+ blocks stay smooth; a delta frame
// repaints only its blocks. LoRA adapters' weights live in runs of GPU blocks: striped, a colour
// per adapter, named in the tooltip and on the run's first block. The stream is read with fetch(), not EventSource, because
// EventSource cannot send the Authorization header a server with --api-key needs. Every URL is
// relative to the page, so the map also works behind a reverse proxy's path prefix.

const COLORS = {
  free: "#242c3a",
  cached: "#3d5a73",
  tierHit: "#f0c040",
  shared: "#b07ad8",
  draft: "#ff9d3c",
  text: "#ffffff",
  bg: "#181e28",
};
const TOOLTIP_HOLDERS = 6; // a prompt shared by hundreds of requests would fill the screen
const CHART_SECONDS = 300;
const KEY_STORAGE = "pagedkv-api-key";

// One pool (GPU or CPU): block states, layout and drawing.
class Pool {
  constructor(name, canvas, counter) {
    this.name = name;
    this.canvas = canvas;
    this.counter = counter;
    this.blocks = []; // [ref, cached, r0, s0, p0, ...] per block id
    this.drafts = new Map(); // block id -> slots holding speculative drafts not accepted yet
    this.adapters = new Map(); // block id -> [adapter name, index in its run, run length]
    this.cell = 8;
    this.columns = 1;
  }

  reset(blocks) {
    this.blocks = blocks;
    this.layout();
    this.draw();
  }

  // Blocks whose draft slots changed are redrawn with the frame's other changes.
  setDrafts(pairs) {
    const before = this.drafts;
    this.drafts = new Map(pairs);
    const changed = new Set([...before.keys(), ...this.drafts.keys()]);
    return [...changed].filter((id) => before.get(id) !== this.drafts.get(id));
  }

  // LoRA adapters' runs of blocks ([first, count, name]); the blocks whose adapter changed
  // are redrawn with the frame's other changes.
  setAdapters(runs) {
    const before = this.adapters;
    this.adapters = new Map();
    for (const [first, count, name] of runs) {
      for (let i = 0; i < count; i += 1) this.adapters.set(first + i, [name, i, count]);
    }
    const changed = new Set([...before.keys(), ...this.adapters.keys()]);
    const same = (a, b) => a && b && a[0] === b[0] && a[1] === b[1];
    return [...changed].filter((id) => !same(before.get(id), this.adapters.get(id)));
  }

  update(changes, redraw = []) {
    for (const [id, ...block] of changes) {
      this.blocks[id] = block;
    }
    if (this.canvas.width !== this.pixelWidth()) {
      this.layout();
      this.draw();
    } else {
      for (const [id] of changes) this.drawBlock(id);
      for (const id of redraw) this.drawBlock(id);
    }
  }

  pixelWidth() {
    return Math.max(1, Math.floor(this.canvas.clientWidth * devicePixelRatio));
  }

  // The largest cell (4..28 CSS px) that fits every block in the width and a screen's height.
  layout() {
    const count = Math.max(1, this.blocks.length);
    const width = Math.max(40, this.canvas.clientWidth);
    const height = Math.max(160, window.innerHeight - this.canvas.getBoundingClientRect().top - 24);
    let cell = 28;
    while (cell > 4 && Math.ceil(count / Math.floor(width / cell)) * cell > height) cell -= 1;
    this.cell = cell;
    this.columns = Math.max(1, Math.floor(width / cell));
    const rows = Math.ceil(count / this.columns);
    this.canvas.style.height = `${rows * cell}px`;
    this.canvas.width = this.pixelWidth();
    this.canvas.height = Math.floor(rows * cell * devicePixelRatio);
    this.counter.textContent = `${this.blocks.length.toLocaleString()} blocks`;
  }

  draw() {
    const ctx = this.canvas.getContext("2d");
    ctx.fillStyle = COLORS.bg;
    ctx.fillRect(0, 0, this.canvas.width, this.canvas.height);
    for (let id = 0; id < this.blocks.length; id += 1) this.drawBlock(id);
  }

  drawBlock(id) {
    const block = this.blocks[id];
    const ctx = this.canvas.getContext("2d");
    const scale = devicePixelRatio;
    const gap = this.cell >= 7 ? 1 : 0;
    const x = (id % this.columns) * this.cell * scale;
    const y = Math.floor(id / this.columns) * this.cell * scale;
    const size = (this.cell - gap) * scale;
    ctx.fillStyle = COLORS.bg;
    ctx.fillRect(x, y, this.cell * scale, this.cell * scale);
    const [ref, cached] = block;
    const adapter = this.adapters.get(id);
    if (adapter) {
      this.drawAdapterBlock(ctx, adapter, x, y, size, scale);
      return;
    }
    if (ref > 1) ctx.fillStyle = COLORS.shared;
    else if (ref === 1) ctx.fillStyle = ownerColor(block[2], block[3]);
    else if (cached === 2) ctx.fillStyle = COLORS.tierHit; // host tier: just copied back
    else ctx.fillStyle = cached ? COLORS.cached : COLORS.free;
    ctx.fillRect(x, y, size, size);
    if (ref > 0 && cached && size >= 6) {
      ctx.fillStyle = "#ffffff88"; // held and reusable by later prompts: a light base line
      ctx.fillRect(x, y + size - Math.max(1, size / 6), size, Math.max(1, size / 6));
    }
    const drafts = this.drafts.get(id) || 0;
    if (drafts > 0) {
      // Slots of drafts not accepted yet: a bar along the top, as long as their share.
      const share = Math.min(1, drafts / state.blockSize);
      ctx.fillStyle = COLORS.draft;
      ctx.fillRect(x, y, Math.max(scale, size * share), Math.max(scale, size / 4));
    }
    if (ref > 1) {
      if (size >= 11 * scale) {
        ctx.fillStyle = COLORS.text;
        ctx.font = `bold ${Math.floor(size * 0.62)}px monospace`;
        ctx.textAlign = "center";
        ctx.textBaseline = "middle";
        ctx.fillText(String(ref), x + size / 2, y + size / 2 + scale);
      } else {
        ctx.fillStyle = COLORS.text; // too small for digits: a corner mark says "shared"
        ctx.fillRect(x, y, Math.max(1, size / 3), Math.max(1, size / 3));
      }
    }
  }

  // A block of a LoRA adapter's weights: its adapter's colour, striped, its name on the first.
  drawAdapterBlock(ctx, [name, index], x, y, size, scale) {
    ctx.fillStyle = ownerColor(name, 0);
    ctx.fillRect(x, y, size, size);
    ctx.strokeStyle = "#ffffffaa";
    ctx.lineWidth = Math.max(1, scale);
    ctx.beginPath();
    ctx.moveTo(x, y + size);
    ctx.lineTo(x + size, y);
    ctx.stroke();
    if (index === 0 && size >= 11 * scale) {
      ctx.fillStyle = COLORS.text;
      ctx.font = `bold ${Math.floor(size * 0.5)}px monospace`;
      ctx.textAlign = "left";
      ctx.textBaseline = "middle";
      ctx.fillText(name.slice(0, 1).toUpperCase(), x + scale, y + size / 2);
    }
  }

  blockAt(event) {
    const rect = this.canvas.getBoundingClientRect();
    const column = Math.floor((event.clientX - rect.left) / this.cell);
    const row = Math.floor((event.clientY - rect.top) / this.cell);
    if (column < 0 || column >= this.columns) return -1;
    const id = row * this.columns + column;
    return id >= 0 && id < this.blocks.length ? id : -1;
  }

  // Page coordinates of a block's centre (used by the browser test, handy in the console).
  blockCentre(id) {
    const rect = this.canvas.getBoundingClientRect();
    return {
      x: rect.left + ((id % this.columns) + 0.5) * this.cell,
      y: rect.top + (Math.floor(id / this.columns) + 0.5) * this.cell,
    };
  }

  heldBlocks() {
    const held = [];
    this.blocks.forEach((block, id) => {
      if (block[0] > 0) held.push(id);
    });
    return held;
  }
}

// A stable, well-spread colour per request (golden-angle hues), a shade per sample.
function ownerColor(nameIndex, sample) {
  const name = state.names.get(nameIndex) || "";
  let hash = 0;
  for (let i = 0; i < name.length; i += 1) hash = (hash * 31 + name.charCodeAt(i)) | 0;
  const hue = (Math.abs(hash) * 137.508) % 360;
  return `hsl(${hue.toFixed(0)} 62% ${52 + ((sample * 9) % 27) - 9}%)`;
}

const state = {
  names: new Map(),
  blockSize: 16,
  frames: 0,
  history: [],
  gpu: new Pool("GPU", document.getElementById("gpu"), document.getElementById("gpu-count")),
  cpu: new Pool("CPU", document.getElementById("cpu"), document.getElementById("cpu-count")),
  offload: new Pool(
    "Host tier",
    document.getElementById("offload"),
    document.getElementById("offload-count"),
  ),
};
const POOLS = ["gpu", "cpu", "offload"];
window.pagemap = state; // for the browser test and for poking around in the console

function applyFrame(frame) {
  if (frame.type === "full") state.names.clear();
  for (const [index, name] of Object.entries(frame.names)) state.names.set(Number(index), name);
  state.blockSize = frame.block_size;
  document.getElementById("offload-pool").hidden = frame.num_offload_blocks === 0;
  const redraw = [
    ...state.gpu.setDrafts(frame.drafts || []),
    ...state.gpu.setAdapters(frame.adapters || []),
  ];
  for (const pool of POOLS) {
    if (frame.type === "full") state[pool].reset(frame[pool]);
    else state[pool].update(frame[pool], pool === "gpu" ? redraw : []);
  }
  showFigures(frame.stats, frame.time);
  state.frames += 1;
  document.body.dataset.frames = String(state.frames);
}

function showFigures(stats, time) {
  const percent = (value) => `${(100 * value).toFixed(1)}%`;
  text("kv-usage", percent(stats.kv_usage));
  text("kv-util", percent(stats.kv_utilisation));
  text("hit-rate", percent(stats.prefix_hit_rate));
  text("requests", `${stats.num_running} / ${stats.num_waiting} / ${stats.num_swapped}`);
  text("tokens-per-s", stats.tokens_per_s.toFixed(1));
  text("pool-size", `${stats.num_gpu_blocks.toLocaleString()} × ${stats.block_size}`);
  const kib = (stats.kv_bytes_per_block / 1024).toFixed(stats.kv_bytes_per_block < 10240 ? 1 : 0);
  const ranks = stats.tensor_parallel_size;
  const perRank = ranks > 1 ? ` per rank × ${ranks} ranks` : "";
  text("kv-dtype", `${stats.kv_cache_dtype} · ${kib} KiB/block${perRank}`);
  state.history.push([time, stats.kv_usage, stats.kv_utilisation]);
  while (state.history.length && state.history[0][0] < time - CHART_SECONDS) state.history.shift();
  drawChart(time);
}

function text(id, value) {
  document.getElementById(id).textContent = value;
}

function drawChart(now) {
  const canvas = document.getElementById("chart");
  const scale = devicePixelRatio;
  canvas.width = Math.floor(canvas.clientWidth * scale);
  canvas.height = Math.floor(canvas.clientHeight * scale);
  const ctx = canvas.getContext("2d");
  const { width, height } = canvas;
  const pad = 4 * scale;
  ctx.clearRect(0, 0, width, height);
  ctx.strokeStyle = "#ffffff22";
  ctx.beginPath();
  ctx.moveTo(0, pad);
  ctx.lineTo(width, pad);
  ctx.stroke();
  const line = (column, color, dash) => {
    ctx.strokeStyle = color;
    ctx.lineWidth = 1.5 * scale;
    ctx.setLineDash(dash.map((d) => d * scale));
    ctx.beginPath();
    state.history.forEach((point, i) => {
      const x = width - ((now - point[0]) / CHART_SECONDS) * width;
      const y = height - pad - point[column] * (height - 2 * pad);
      if (i === 0) ctx.moveTo(x, y);
      else ctx.lineTo(x, y);
    });
    ctx.stroke();
  };
  line(1, "#5ab0e0", []);
  line(2, "#8fd18f", [4, 3]);
  ctx.setLineDash([]);
  ctx.fillStyle = "#8a94a6";
  ctx.font = `${11 * scale}px system-ui, sans-serif`;
  ctx.textBaseline = "top";
  ctx.fillText("KV usage (solid), utilisation (dashed), last 5 minutes", 2 * pad, 2 * pad);
}

// Hover: the block's owner(s), position in each sequence, ref count and cache state.
function describe(pool, id) {
  const [ref, cached, ...holders] = pool.blocks[id];
  const adapter = pool.adapters.get(id);
  if (adapter) {
    const [name, index, count] = adapter;
    return `${pool.name} block ${id}\nLoRA adapter ${name}: its weights, block ${index + 1} of ${count}`;
  }
  const lines = [`${pool.name} block ${id}`, `ref count ${ref}${ref > 1 ? " (shared)" : ""}`];
  lines.push(`prefix cache: ${cached ? "yes" : "no"}`);
  if (pool === state.offload) {
    if (cached === 2) lines.push("copied back to the GPU just now");
  } else if (ref === 0) {
    lines.push(cached ? "free, KV kept for reuse" : "free");
  }
  const drafts = pool.drafts.get(id) || 0;
  if (drafts > 0) lines.push(`${drafts} slot${drafts > 1 ? "s" : ""} of drafts not accepted yet`);
  const shown = Math.min(holders.length, 3 * TOOLTIP_HOLDERS);
  for (let i = 0; i < shown; i += 3) {
    const [name, sample, position] = holders.slice(i, i + 3);
    const first = position * state.blockSize;
    lines.push(
      `${state.names.get(name)} sample ${sample}: block ${position}, ` +
        `tokens ${first}–${first + state.blockSize - 1}`,
    );
  }
  if (shown < holders.length) lines.push(`… and ${(holders.length - shown) / 3} more`);
  return lines.join("\n");
}

function attachTooltip(pool) {
  const tooltip = document.getElementById("tooltip");
  pool.canvas.addEventListener("mousemove", (event) => {
    const id = pool.blockAt(event);
    if (id < 0) {
      tooltip.hidden = true;
      return;
    }
    tooltip.textContent = describe(pool, id);
    tooltip.hidden = false;
    const left = Math.min(event.clientX + 14, window.innerWidth - tooltip.offsetWidth - 4);
    tooltip.style.left = `${Math.max(4, left)}px`;
    tooltip.style.top = `${event.clientY + 14}px`;
  });
  pool.canvas.addEventListener("mouseleave", () => {
    tooltip.hidden = true;
  });
}

// The stream: fetch + a small SSE parser, reconnecting after errors.
async function follow() {
  const status = document.getElementById("status");
  const headers = {};
  const key = sessionStorage.getItem(KEY_STORAGE);
  if (key) headers.Authorization = `Bearer ${key}`;
  try {
    const response = await fetch("v1/kv/stream", { headers });
    if (response.status === 401) {
      status.textContent = "needs an API key";
      status.className = "status error";
      document.getElementById("key-form").hidden = false;
      return;
    }
    if (!response.ok) throw new Error(await refusal(response));
    status.textContent = "live";
    status.className = "status live";
    const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
    let buffer = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buffer += value;
      let end;
      while ((end = buffer.indexOf("\n\n")) >= 0) {
        const event = buffer.slice(0, end);
        buffer = buffer.slice(end + 2);
        const data = event
          .split("\n")
          .filter((line) => line.startsWith("data:"))
          .map((line) => line.slice(5).trimStart())
          .join("\n");
        if (data) applyFrame(JSON.parse(data));
      }
    }
    throw new Error("stream ended");
  } catch (error) {
    status.textContent = `disconnected (${error.message}); retrying…`;
    status.className = "status error";
    setTimeout(follow, 1000);
  }
}

// Why the server refused the stream (its error in OpenAI's shape: too many viewers, shutting
// down), or else the status.
async function refusal(response) {
  try {
    return (await response.json()).error.message;
  } catch {
    return `HTTP ${response.status}`;
  }
}

document.getElementById("key-form").addEventListener("submit", (event) => {
  event.preventDefault();
  sessionStorage.setItem(KEY_STORAGE, document.getElementById("key").value);
  document.getElementById("key-form").hidden = true;
  follow();
});
window.addEventListener("resize", () => {
  for (const pool of POOLS) {
    state[pool].layout();
    state[pool].draw();
  }
});
for (const pool of POOLS) attachTooltip(state[pool]);
follow();
