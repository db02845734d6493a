// The shardlb operator dashboard: a few views over the router's API, no framework.
// Every value shown is set as text (textContent, SVG attributes), never parsed as HTML: player and
// board ids are user input. The admin key lives in sessionStorage and travels only in the
// Authorization header; the location hash holds nothing but the view (board, period, offset).
"use strict";

const KEY = "shardlb.adminKey";
const PAGE = 100;
const TOP_EVERY_MS = 1000;
const CLUSTER_EVERY_MS = 2000;
const HISTORY = 90; // chart points kept: three minutes at one every two seconds
const MIN_SPAN = 20; // the x axis of a chart starts as 20 points wide and grows to HISTORY
const REFUSED_RETRY_S = 5; // a view refused for now is asked for again this often, without a Retry-After
const POLL_WAIT_MAX_S = 60; // a poll refused with a Retry-After waits it, up to this long
const LATER = new Set([408, 429, 502, 503, 504]); // "come back later": the client's retried statuses

const $ = (id) => document.getElementById(id);
let timers = [];
let generation = 0; // bumped on each view change: answers for an older view are dropped

class ApiError extends Error {
  constructor(status, code, message, retryAfter) {
    super(message);
    this.status = status;
    this.code = code;
    this.retryAfter = retryAfter; // seconds, from Retry-After (NaN without one)
  }
}

// A fetch that got no answer at all (the router restarting, the network cut): no status, no code.
class NoAnswer extends Error {}

// ---- the API --------------------------------------------------------------------------------

async function api(path, options = {}) {
  const headers = { Accept: "application/json", ...(options.headers || {}) };
  const key = sessionStorage.getItem(KEY);
  if (key) headers.Authorization = "Bearer " + key;
  let response;
  try {
    response = await fetch(path, { ...options, headers, cache: "no-store", credentials: "omit" });
  } catch (error) {
    throw new NoAnswer(error.message);
  }
  if (response.status === 204) return null;
  let body = null;
  try {
    body = await response.json();
  } catch (_) {
    body = null;
  }
  if (!response.ok) {
    const error = (body && body.error) || {};
    if (response.status === 401 && path.startsWith("/v1/")) {
      sessionStorage.removeItem(KEY);
      showLogin("The key was refused (401): enter it again.");
    }
    const retryAfter = parseInt(response.headers.get("Retry-After") || "", 10);
    throw new ApiError(response.status, error.code || "http_" + response.status, error.message || response.statusText, retryAfter);
  }
  return body;
}

const seg = encodeURIComponent;

// A refusal that says "come back later" (or no answer): what the view asks again, after Retry-After.
function forNow(error) {
  return error instanceof NoAnswer || (error instanceof ApiError && LATER.has(error.status));
}

function waitFor(error) {
  return Math.max(1, error.retryAfter || REFUSED_RETRY_S);
}

// How long a poll refused for now waits before the next (ms): its Retry-After, at most
// POLL_WAIT_MAX_S; none without one (the poll keeps its rhythm).
function pollWait(error) {
  if (!forNow(error) || !(error.retryAfter > 0)) return undefined;
  return Math.min(error.retryAfter, POLL_WAIT_MAX_S) * 1000;
}

function said(error) {
  return error instanceof ApiError ? `${error.status} ${error.code}: ${error.message}` : `no answer: ${error.message}`;
}

function query(params) {
  const search = new URLSearchParams();
  for (const [name, value] of Object.entries(params)) {
    if (value !== null && value !== undefined && value !== "") search.set(name, String(value));
  }
  const text = search.toString();
  return text ? "?" + text : "";
}

// ---- small DOM helpers ----------------------------------------------------------------------

function el(tag, text, className) {
  const node = document.createElement(tag);
  if (text !== undefined && text !== null) node.textContent = String(text);
  if (className) node.className = className;
  return node;
}

function row(cells) {
  const tr = document.createElement("tr");
  for (const cell of cells) tr.append(cell instanceof Node ? wrapCell(cell) : el("td", cell));
  return tr;
}

function wrapCell(node) {
  if (node.tagName === "TD") return node;
  const td = document.createElement("td");
  td.append(node);
  return td;
}

function fill(tbody, rows) {
  tbody.replaceChildren(...rows);
}

function notice(text, isError) {
  const box = $("notice");
  box.textContent = text || "";
  box.className = isError ? "error" : "";
}

function bytes(n) {
  if (n === null || n === undefined) return "–";
  if (n === 0) return "0";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  let v = Number(n);
  while (v >= 1024 && i < units.length - 1) {
    v /= 1024;
    i += 1;
  }
  return (i === 0 ? v : v.toFixed(1)) + " " + units[i];
}

function show(section) {
  for (const id of ["login", "boards", "board", "cluster"]) $(id).hidden = id !== section;
  $("nav").hidden = section === "login";
}

// Call fn now and every ms; a call still waiting for its answers makes the next one skip its turn,
// so a slow router is not sent a pile of polls. A call that returns a number of ms (a refusal's
// Retry-After: ``pollWait``) makes the turns skip until that long has passed.
function every(ms, fn) {
  let running = false;
  let until = 0;
  const tick = async () => {
    if (running || Date.now() < until) return;
    running = true;
    try {
      const wait = await fn();
      until = typeof wait === "number" ? Date.now() + wait : 0;
    } finally {
      running = false;
    }
  };
  tick();
  timers.push(setInterval(tick, ms));
}

function failed(error) {
  if (error instanceof ApiError && error.status === 401) return;
  notice(error instanceof ApiError ? `${error.status} ${error.code}: ${error.message}` : String(error), true);
}

// ---- views: routing by the location hash ----------------------------------------------------

function parseHash() {
  const [path, search] = location.hash.replace(/^#/, "").split("?");
  const decode = (part) => {
    try {
      return decodeURIComponent(part);
    } catch (_) {
      return part; // a malformed escape: shown as typed, and the API refuses it as an id
    }
  };
  const parts = (path || "/boards").split("/").filter(Boolean).map(decode);
  return { parts, params: new URLSearchParams(search || "") };
}

function go(hash) {
  if (location.hash === hash) route();
  else location.hash = hash;
}

function route() {
  timers.forEach(clearInterval);
  timers = [];
  generation += 1;
  notice("");
  if (!sessionStorage.getItem(KEY)) {
    showLogin("");
    return;
  }
  const { parts, params } = parseHash();
  if (parts[0] === "board" && parts[1]) openBoard(parts[1], params);
  else if (parts[0] === "cluster") openCluster();
  else openBoards();
}

// ---- login ----------------------------------------------------------------------------------

function showLogin(message) {
  timers.forEach(clearInterval);
  timers = [];
  show("login");
  $("login-error").textContent = message || "";
  $("key").focus();
}

async function login(event) {
  event.preventDefault();
  const key = $("key").value.trim();
  if (!key) return;
  sessionStorage.setItem(KEY, key);
  try {
    await api("/v1/admin/cluster");
  } catch (error) {
    sessionStorage.removeItem(KEY);
    const why = error instanceof ApiError && error.status === 403 ? "this key is not an admin key (403)" : error.message;
    showLogin("Not signed in: " + why);
    return;
  }
  $("key").value = "";
  route();
}

function logout() {
  sessionStorage.removeItem(KEY);
  showLogin("");
}

// ---- boards ---------------------------------------------------------------------------------

function sharding(s) {
  if (s.strategy === "region") return `region: ${s.regions.join(", ")} × ${s.shards_per_region}`;
  if (s.strategy === "band") return `band: ${s.bands.length} bands + ${s.shards}`;
  return `hash: ${s.shards} shards`;
}

// A board's players the list could not read: its state when the router names one.
function unread(error) {
  if (!(error instanceof ApiError)) return "–";
  const refusal = `(${error.status} ${error.code})`;
  if (error.code === "board_rebuilding") return `being rebuilt ${refusal}`;
  if (error.code === "board_resharding") return `being resharded ${refusal}`;
  return `– ${refusal}`;
}

async function openBoards() {
  show("boards");
  const mine = generation;
  try {
    const { boards } = await api("/v1/boards");
    const details = await Promise.all(boards.map((b) => api(`/v1/boards/${seg(b.board)}`).catch((error) => error)));
    if (mine !== generation) return;
    fill(
      $("boards-table").tBodies[0],
      boards.map((b, i) => {
        const link = el("a", b.board);
        link.href = `#/board/${seg(b.board)}`;
        const players = details[i] instanceof Error ? unread(details[i]) : Object.entries(details[i].players).map(([k, n]) => `${k} ${n}`).join(", ");
        return row([link, b.mode, b.order, b.periods.join(", "), sharding(b.sharding), b.durability, b.timezone, players]);
      }),
    );
    if (!boards.length) notice("No boards yet: create one with PUT /v1/boards/{board}.");
  } catch (error) {
    failed(error);
  }
}

// ---- one board ------------------------------------------------------------------------------

const boardState = { id: null, config: null, period: "total", region: "", offset: 0, player: "" };

function boardHash(changes = {}) {
  const s = { ...boardState, ...changes };
  const params = { period: s.period === "total" ? "" : s.period, region: s.region, offset: s.offset || "", player: s.player };
  return `#/board/${seg(s.id)}` + query(params);
}

function switches(container, values, current, label, onPick) {
  container.replaceChildren(
    ...values.map((value) => {
      const button = el("button", label(value), value === current ? "on" : "");
      button.type = "button";
      button.dataset.value = value;
      button.setAttribute("aria-pressed", String(value === current));
      button.addEventListener("click", () => onPick(value));
      return button;
    }),
  );
}

async function openBoard(id, params) {
  show("board");
  const mine = generation;
  boardState.id = id;
  boardState.period = params.get("period") || "total";
  boardState.region = params.get("region") || "";
  boardState.offset = Math.max(0, parseInt(params.get("offset") || "0", 10) || 0);
  boardState.player = params.get("player") || "";
  $("board-name").textContent = id;
  $("offset").value = String(boardState.offset);
  // Nothing of the view shown before stays on screen: an answer for this view replaces it, or an
  // error leaves it empty (never another board's or period's rows under this one's name).
  $("board-settings").textContent = "";
  $("periods").replaceChildren();
  $("regions-wrap").hidden = true;
  fill($("entries").tBodies[0], []);
  $("page-info").textContent = "";
  stale(["entries", "page-info"], false);
  $("player").hidden = true;
  try {
    const config = await api(`/v1/boards/${seg(id)}`);
    if (mine !== generation) return;
    boardState.config = config;
    const sizes = Object.entries(config.players).map(([k, n]) => `${k}: ${n} players`).join(" · ");
    $("board-settings").textContent =
      `${config.mode}, ${config.order}, ties: ${config.tiebreak}, ${sharding(config.sharding)}, ` +
      `${config.durability}, timezone ${config.timezone} — ${sizes}`;
    switches($("periods"), config.periods, boardState.period, (k) => k, (k) => go(boardHash({ period: k, offset: 0 })));
    $("period-name").value = config.periods.includes(boardState.period) ? "" : boardState.period;
    const regions = config.sharding.strategy === "region" ? ["", ...config.sharding.regions] : [];
    $("regions-wrap").hidden = !regions.length;
    switches($("regions"), regions, boardState.region, (r) => r || "all", (r) => go(boardHash({ region: r, offset: 0 })));
  } catch (error) {
    if (mine !== generation) return;
    failed(error);
    if (forNow(error)) await refusedForNow(error, mine);
    return;
  }
  const refresh = () => loadPage(mine);
  if (boardState.offset === 0) every(TOP_EVERY_MS, refresh); // the cached top: cheap to poll
  else refresh(); // a deep page is read from every shard: once, and again on demand
  $("search").value = boardState.player;
  $("player-error").textContent = "";
  if (boardState.player) searchPlayer(boardState.player);
  else $("player").hidden = true;
}

// The board view refused for now: a board with shards not rebuilt (a loss of Redis) or resharded, an
// overloaded router, the read limit, no answer. Not a failure of the board: a state that ends, said
// in place of its settings, with nothing of the view left on screen (rows read before it would be
// taken for the present); the view is opened again after Retry-After until it answers.
async function refusedForNow(error, mine) {
  timers.forEach(clearInterval); // the live top's poll too: clearInterval clears a timeout as well
  timers = [];
  const wait = waitFor(error);
  const id = boardState.id;
  let text = `The router cannot answer for this board now (${said(error)}). This view opens by itself once it does (asking again every ${wait} s).`;
  if (error.code === "board_resharding") {
    text = "This board is being resharded (its layout is changing): the router refuses what the cut-over would leave inexact. " +
      `This view opens by itself once it answers (asking again every ${wait} s).`;
  } else if (error.code === "board_rebuilding") {
    const shards = await notRebuilt(id);
    if (mine !== generation) return;
    const again = `This view opens by itself once the board answers (asking again every ${wait} s).`;
    if (shards.length) {
      const commands = shards.map((n) => `\`shardlb rebuild ${id} --shard ${n}\``).join(", ");
      text = `Shard${shards.length > 1 ? "s" : ""} ${shards.join(", ")} of this board lost ${shards.length > 1 ? "their" : "its"} data in Redis and ${shards.length > 1 ? "are" : "is"} not rebuilt yet: ` +
        "the board's reads and writes that need them are refused until they are. Unless a `shardlb rebuild` " +
        `of the board (or \`shardlb rebuild --all\`, after a loss of all of Redis) is under way, an operator runs ${commands}. ${again}`;
    } else {
      // The shard map did not answer (or named none): the API's own message names them.
      text = `The router refuses this board for now: ${error.message}. ${again}`;
    }
  }
  $("board-settings").textContent = text;
  $("periods").replaceChildren();
  fill($("entries").tBodies[0], []);
  $("page-info").textContent = "";
  stale(["entries", "page-info"], false);
  $("player").hidden = true;
  timers.push(setTimeout(() => mine === generation && route(), wait * 1000));
}

// The shards of a board marked not rebuilt, from the shard map (empty when it does not answer).
async function notRebuilt(id) {
  try {
    const map = await api(`/v1/admin/boards/${seg(id)}/shards`);
    return map.shards.filter((s) => s.rebuilding).map((s) => s.shard);
  } catch (_) {
    return [];
  }
}

async function loadPage(mine) {
  const s = boardState;
  const where = { period: s.period, region: s.region };
  try {
    const page =
      s.offset === 0
        ? await api(`/v1/boards/${seg(s.id)}/top` + query({ ...where, limit: PAGE }))
        : await api(`/v1/boards/${seg(s.id)}/entries` + query({ ...where, offset: s.offset, limit: PAGE }));
    if (mine !== generation) return;
    fill(
      $("entries").tBodies[0],
      page.entries.map((e) => row([el("td", e.rank, "num rank"), el("td", e.player_id, "player"), el("td", e.points, "num points"), el("td", e.achieved_at, "when")])),
    );
    const what =
      s.offset === 0
        ? "live top, refreshed every second"
        : page.entries.length
          ? `ranks ${s.offset + 1}–${s.offset + page.entries.length}`
          : `no entries past rank ${s.offset}`;
    $("page-info").textContent = `${page.period} · ${what} · as of ${page.as_of}`;
    $("page-info").dataset.period = page.period;
    stale(["entries", "page-info"], false);
    if ($("notice").className === "error") notice(""); // a refresh that worked ends an error, not news
  } catch (error) {
    if (mine !== generation) return;
    failed(error);
    stale(["entries", "page-info"], true); // the last answer stays, marked as not the present
    if (error instanceof ApiError && error.code === "board_rebuilding") {
      // A shard lost while the board is open: its counts and rows are of the shards left.
      await refusedForNow(error, mine);
    } else if (s.offset !== 0 && forNow(error)) {
      // A page is read once, not polled as the top is: read again after Retry-After.
      const wait = waitFor(error);
      $("page-info").textContent = `refused for now (${said(error)}): asking again in ${wait} s`;
      timers.push(setTimeout(() => mine === generation && loadPage(mine), wait * 1000));
    } else if (s.offset === 0) {
      // The live top (``every``): refused with a Retry-After, the next poll waits it (bounded).
      return pollWait(error);
    }
  }
}

function setOffset(offset) {
  go(boardHash({ offset: Math.max(0, offset) }));
}

async function searchPlayer(player) {
  const s = boardState;
  const mine = generation;
  const where = query({ period: s.period, region: s.region });
  $("player-error").textContent = "";
  try {
    const [found, around] = await Promise.all([
      api(`/v1/boards/${seg(s.id)}/players/${seg(player)}` + where),
      api(`/v1/boards/${seg(s.id)}/players/${seg(player)}/around` + query({ period: s.period, region: s.region, radius: 5 })),
    ]);
    if (mine !== generation) return;
    $("player-id").textContent = found.player_id;
    $("player-rank").textContent = String(found.rank);
    $("player-points").textContent = String(found.points);
    $("player-percentile").textContent = Number(found.percentile).toFixed(2);
    $("player-players").textContent = String(found.players);
    $("player-period").textContent = around.period;
    fill(
      $("around").tBodies[0],
      around.entries.map((e) => {
        const tr = row([el("td", e.rank, "num rank"), el("td", e.player_id, "player"), el("td", e.points, "num points")]);
        if (e.player_id === found.player_id) tr.className = "me";
        return tr;
      }),
    );
    $("remove").dataset.player = found.player_id;
    $("player").hidden = false;
  } catch (error) {
    if (mine !== generation) return;
    $("player").hidden = true;
    const why = error instanceof ApiError ? `${error.status} ${error.code}: ${error.message}` : String(error);
    $("player-error").textContent = `${player}: ${why}`;
  }
}

function confirmDialog(text) {
  return new Promise((resolve) => {
    const dialog = $("confirm");
    $("confirm-text").textContent = text;
    const done = (answer) => {
      $("confirm-yes").onclick = null;
      $("confirm-no").onclick = null;
      dialog.close();
      resolve(answer);
    };
    $("confirm-yes").onclick = () => done(true);
    $("confirm-no").onclick = () => done(false);
    dialog.oncancel = () => done(false);
    dialog.showModal();
  });
}

// A removal whose answer was lost or refused for now (a shard lost alone: 503 board_rebuilding, after
// the router audited it), with its X-Request-Id: the router's retry key for removals. Confirmed again
// (same board, player and reason) it goes with the same id, so the router takes it as the same call,
// audited once and made at the first call's time, not as a second removal.
let unfinished = null;

function newRequestId() {
  const bytes = crypto.getRandomValues(new Uint8Array(16)); // randomUUID needs a secure context
  return "dashboard-" + Array.from(bytes, (b) => b.toString(16).padStart(2, "0")).join("");
}

async function removePlayer() {
  const player = $("remove").dataset.player;
  const board = boardState.id;
  const again = unfinished && unfinished.board === board && unfinished.player === player ? unfinished : null;
  $("confirm-reason").value = again ? again.reason : "";
  const question = `Remove player "${player}" from board "${board}"? Their entries in every period of this board are deleted (their later results count again).`;
  if (!player || !(await confirmDialog(question))) return;
  const reason = $("confirm-reason").value.trim();
  const id = again && again.reason === reason ? again.id : newRequestId();
  unfinished = { board, player, reason, id };
  try {
    const path = `/v1/boards/${seg(board)}/players/${seg(player)}` + query({ reason });
    const done = await api(path, { method: "DELETE", headers: { "X-Request-Id": id } });
    unfinished = null;
    notice(done && done.removed === false ? `${player} had no entry on ${board}: nothing removed.` : `Removed ${player} from ${board}.`);
    $("player").hidden = true;
    loadPage(generation);
  } catch (error) {
    if (!forNow(error)) unfinished = null;
    const retry = "Remove again to retry it: the same call, which the router makes once.";
    // 405 (or 404 "no such route"): a router from before the moderation endpoint.
    const missing = error instanceof ApiError && (error.status === 405 || (error.status === 404 && error.code === "not_found"));
    // No answer at all (a failed fetch has no status): the router may have made the removal.
    $("player-error").textContent = missing
      ? "Removing players is not available on this router (it has no DELETE /v1/boards/{board}/players/{player})."
      : error instanceof ApiError
        ? `${error.status} ${error.code}: ${error.message}` + (forNow(error) ? ` ${retry}` : "")
        : `no answer from the router (${error.message}): ${player} may have been removed; search again to see, or ${retry[0].toLowerCase()}${retry.slice(1)}`;
  }
}

// ---- cluster: nodes, shard map, traffic -----------------------------------------------------

const traffic = { last: null, points: [] };

async function openCluster() {
  show("cluster");
  const mine = generation;
  try {
    const { boards } = await api("/v1/boards");
    if (mine !== generation) return;
    const select = $("shard-board");
    const kept = select.value;
    select.replaceChildren(...boards.map((b) => Object.assign(el("option", b.board), { value: b.board })));
    if (boards.some((b) => b.board === kept)) select.value = kept;
    periodsFor(boards);
    select.onchange = () => {
      periodsFor(boards);
      loadShards(mine);
    };
    $("shard-period").onchange = () => loadShards(mine);
  } catch (error) {
    failed(error);
  }
  // A poll whose three reads all answered ends an error shown earlier; one that failed says so itself.
  every(CLUSTER_EVERY_MS, async () => {
    const answered = await Promise.all([loadNodes(mine), loadTraffic(mine), loadShards(mine)]);
    if (mine === generation && answered.every(Boolean) && $("notice").className === "error") notice("");
  });
}

// What a failed poll leaves on screen is the last answer: marked stale, never shown as current.
function stale(ids, isStale) {
  for (const id of ids) $(id).classList.toggle("stale", isStale);
}

function periodsFor(boards) {
  const board = boards.find((b) => b.board === $("shard-board").value);
  const select = $("shard-period");
  select.replaceChildren(...(board ? board.periods : []).map((p) => Object.assign(el("option", p), { value: p })));
}

async function loadNodes(mine) {
  try {
    const [cluster, ready] = await Promise.all([api("/v1/admin/cluster"), readiness()]);
    if (mine !== generation) return;
    const state = $("cluster-state");
    state.textContent =
      `cluster_state ${cluster.state} · ${cluster.slots_ok} of 16384 slots ok · ${cluster.primaries} primaries, ` +
      `${cluster.known_nodes} nodes · router ${cluster.ready ? "ready" : "NOT ready: " + cluster.problem}`;
    state.className = "state " + (cluster.ready && cluster.state === "ok" ? "ok" : "bad");
    fill(
      $("nodes").tBodies[0],
      cluster.nodes.map((n) =>
        row([
          n.address,
          n.role,
          n.primary || "",
          el("td", n.slots, "num"),
          n.failing ? "FAILING" : n.connected ? "connected" : "disconnected",
          el("td", bytes(n.memory.used), "num"),
          el("td", bytes(n.memory.peak), "num"),
          el("td", n.memory.max ? bytes(n.memory.max) : "no limit", "num"),
        ]),
      ),
    );
    const journal = ready.journal || {};
    $("journal-board").textContent = ready.error ? ready.error : journal.board || "none (no journaled board behind)";
    $("journal-results").textContent = String(journal.results ?? "–");
    $("journal-results-bound").textContent = String(journal.results_bound ?? "–");
    $("journal-entries").textContent = String(journal.entries ?? "–");
    $("journal-seconds").textContent = String(journal.seconds ?? "–");
    $("journal-bound").textContent = String(journal.bound ?? "–");
    // Abandoned: no mover for a lease (router/reshards.py); a router that may take it resumes it.
    const moving = ready.reshards;
    $("reshards").textContent = !moving ? "–" : `${moving.under_way} under way` +
      (moving.abandoned.length ? ` · ABANDONED, no mover: ${moving.abandoned.join(", ")}` : "");
    stale(["nodes", "durability"], false);
    return true;
  } catch (error) {
    if (mine !== generation) return false;
    failed(error);
    const why = error instanceof ApiError ? `${error.status} ${error.code}` : "no answer from the router";
    const state = $("cluster-state");
    state.textContent = `cluster state unknown (${why}) · the nodes and journal below are from the last answer`;
    state.className = "state bad";
    stale(["nodes", "durability"], true);
    return false;
  }
}

async function readiness() {
  try {
    return await api("/readyz");
  } catch (error) {
    return { error: `not ready: ${error.message}` };
  }
}

async function loadShards(mine) {
  const board = $("shard-board").value;
  if (!board) return true;
  try {
    const map = await api(`/v1/admin/boards/${seg(board)}/shards` + query({ period: $("shard-period").value }));
    if (mine !== generation) return;
    // Band boards: each shard's role, and how far the largest band is past its share.
    const band = (s) => (s.role === "band" ? `band from ${s.band_from} points` : s.role || "");
    // A shard marked not rebuilt after a loss of Redis: its members are those of an emptied shard.
    const state = (s) => (s.rebuilding ? "NOT REBUILT" : "");
    fill($("shards").tBodies[0], map.shards.map((s) => row([el("td", s.shard, "num"), el("td", s.slot, "num"), s.node || "unassigned", el("td", s.members, "num"), band(s), state(s)])));
    const lost = map.shards.filter((s) => s.rebuilding).map((s) => s.shard);
    $("shard-lost").textContent = !lost.length ? "" :
      `Shard${lost.length > 1 ? "s" : ""} ${lost.join(", ")} not rebuilt after a loss of Redis: reads and writes that need ${lost.length > 1 ? "them" : "it"} ` +
      `are refused (503 board_rebuilding) until a running \`shardlb rebuild --all\`, or for a shard lost alone ` +
      lost.map((n) => `\`shardlb rebuild ${board} --shard ${n}\``).join(", ") + ", brings them back.";
    $("shard-skew").textContent = map.band_skew === undefined ? "" :
      `largest band / mean band: ${map.band_skew} (shardlb bands --apply draws the starts again past 1.5)`;
    stale(["shards"], false);
    return true;
  } catch (error) {
    if (mine !== generation) return false;
    failed(error);
    stale(["shards"], true);
    return false;
  }
}

// The p-quantile of the requests between two snapshots, interpolated inside its bucket as
// Prometheus's histogram_quantile does; past the last finite bound it is that bound.
function quantile(q, bounds, before, after) {
  const counts = after.map((c, i) => c - before[i]);
  const total = counts[counts.length - 1];
  if (total <= 0) return null;
  const target = q * total;
  for (let i = 0; i < bounds.length; i++) {
    if (counts[i] >= target) {
      const low = i === 0 ? 0 : bounds[i - 1];
      const below = i === 0 ? 0 : counts[i - 1];
      const inside = counts[i] - below;
      return low + (bounds[i] - low) * (inside > 0 ? (target - below) / inside : 1);
    }
  }
  return bounds[bounds.length - 1];
}

// Counters only grow: one that went back is another router's (a restart, or a poll that reached
// another pod behind the same address). That answer is the new baseline; no rate is drawn across it.
function wentBack(last, now) {
  const counts = (m) => [m.writes.requests, m.writes.scores, m.reads.requests, ...m.writes.buckets, ...m.reads.buckets];
  const before = counts(last);
  return counts(now).some((n, i) => n < before[i]);
}

async function loadTraffic(mine) {
  try {
    const now = await api("/v1/admin/metrics");
    if (mine !== generation) return false;
    const last = traffic.last;
    traffic.last = now;
    if (!last || now.at_ms <= last.at_ms || wentBack(last, now)) return true;
    const seconds = (now.at_ms - last.at_ms) / 1000;
    const rate = (a, b) => (a - b) / seconds;
    const ms = (v) => (v === null ? null : v * 1000);
    traffic.points.push({
      writes: rate(now.writes.requests, last.writes.requests),
      scores: rate(now.writes.scores, last.writes.scores),
      reads: rate(now.reads.requests, last.reads.requests),
      writeP99: ms(quantile(0.99, now.bounds, last.writes.buckets, now.writes.buckets)),
      readP99: ms(quantile(0.99, now.bounds, last.reads.buckets, now.reads.buckets)),
    });
    if (traffic.points.length > HISTORY) traffic.points.shift();
    drawCharts();
    return true;
  } catch (error) {
    if (mine === generation) failed(error);
    return false;
  }
}

function fixed(v) {
  return v === null || v === undefined ? "–" : v >= 100 ? v.toFixed(0) : v.toFixed(1);
}

function drawCharts() {
  const p = traffic.points;
  const latest = p[p.length - 1];
  chart($("chart-requests"), [p.map((x) => x.writes), p.map((x) => x.reads)]);
  chart($("chart-scores"), [p.map((x) => x.scores)]);
  chart($("chart-p99"), [p.map((x) => x.writeP99), p.map((x) => x.readP99)]);
  $("rate-requests").textContent = `now: writes ${fixed(latest.writes)}/s, reads ${fixed(latest.reads)}/s`;
  $("rate-scores").textContent = `now: ${fixed(latest.scores)}/s`;
  $("rate-p99").textContent = `now: writes ${fixed(latest.writeP99)} ms, reads ${fixed(latest.readP99)} ms`;
}

const SVG = "http://www.w3.org/2000/svg";

function svg(tag, attributes, text) {
  const node = document.createElementNS(SVG, tag);
  for (const [name, value] of Object.entries(attributes)) node.setAttribute(name, String(value));
  if (text !== undefined) node.textContent = text;
  return node;
}

// Lines over the points kept (at most HISTORY, the newest on the right once full), scaled to the
// largest value shown; a gap (null: no request in that interval) breaks a line.
function chart(target, series) {
  const width = 300;
  const height = 90;
  const top = 12;
  const values = series.flat().filter((v) => v !== null);
  const max = Math.max(1e-9, ...values);
  const span = Math.max(MIN_SPAN, ...series.map((points) => points.length)) - 1;
  const x = (i) => (width * i) / span;
  const y = (v) => height - 2 - ((height - top - 4) * v) / max;
  const nodes = [svg("line", { x1: 0, y1: height - 2, x2: width, y2: height - 2, class: "axis" }), svg("text", { x: 2, y: 10, class: "scale" }, `max ${fixed(max)}`)];
  series.forEach((points, s) => {
    let path = "";
    points.forEach((v, i) => {
      if (v === null) {
        path += " ";
        return;
      }
      path += `${path === "" || path.endsWith(" ") ? "M" : "L"}${x(i).toFixed(1)},${y(v).toFixed(1)}`;
    });
    if (path.trim()) nodes.push(svg("path", { d: path.trim().replace(/ +/g, " "), class: `line s${s}` }));
  });
  target.replaceChildren(...nodes);
}

// ---- wiring ---------------------------------------------------------------------------------

function start() {
  $("login-form").addEventListener("submit", login);
  $("logout").addEventListener("click", logout);
  $("pager").addEventListener("submit", (event) => {
    event.preventDefault();
    setOffset(parseInt($("offset").value, 10) || 0);
  });
  $("prev").addEventListener("click", () => setOffset(boardState.offset - PAGE));
  $("next").addEventListener("click", () => setOffset(boardState.offset + PAGE));
  $("first").addEventListener("click", () => setOffset(0));
  $("search-form").addEventListener("submit", (event) => {
    event.preventDefault();
    // Through the hash, so that a period or region switch keeps showing the same player.
    const player = $("search").value.trim();
    if (player) go(boardHash({ player }));
  });
  $("period-form").addEventListener("submit", (event) => {
    event.preventDefault();
    const period = $("period-name").value.trim();
    if (period) go(boardHash({ period, offset: 0 }));
  });
  $("remove").addEventListener("click", removePlayer);
  window.addEventListener("hashchange", route);
  route();
}

document.addEventListener("DOMContentLoaded", start);
