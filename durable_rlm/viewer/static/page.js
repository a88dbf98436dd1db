// The episode page's script: polls the page's state while the episode runs (no reload),
// and sends a person's actions. Every text from the server is set with textContent; the
// only HTML inserted is the body the server rendered (and escaped) itself.
"use strict";
(function () {
  const dataNode = document.getElementById("page-data");
  if (!dataNode) return;
  let state = JSON.parse(dataNode.textContent || "{}");
  // While the page is open it holds the shared server (durable_rlm/episode_page.py).
  const lease = state.base + "/episodes/lease";
  setInterval(() => { fetch(lease, { cache: "no-store" }).catch(() => {}); }, 15000);
  if (!state.episode_id) return;
  const here = location.pathname.replace(/\/+$/, "");
  const main = document.getElementById("timeline");
  const controls = document.getElementById("controls");
  const result = document.getElementById("act-result");
  const sender = document.getElementById("sender");
  sender.value = localStorage.getItem("drlm-sender") || state.sender || "";
  sender.addEventListener("change", () => localStorage.setItem("drlm-sender", sender.value));
  let shownPending = null;

  function openKeys() {
    const keys = new Set();
    main.querySelectorAll("details[data-key]").forEach((d) => { if (d.open) keys.add(d.dataset.key); });
    return keys;
  }

  function apply(next, html) {
    if (html !== undefined && next.version === state.version) {
      // Only the clock moved: replace its row, keep the rest (and any selection) as it is.
      const fresh = document.createElement("template");
      fresh.innerHTML = html;  // rendered and escaped by the server
      const row = fresh.content.querySelector('tr[data-budget="time"]');
      const old = main.querySelector('tr[data-budget="time"]');
      if (row && old) old.replaceWith(row);
    } else if (html !== undefined) {
      const keys = openKeys();
      const closed = new Set();
      main.querySelectorAll("details[data-key]").forEach((d) => { if (!d.open) closed.add(d.dataset.key); });
      main.innerHTML = html;  // rendered and escaped by the server
      main.querySelectorAll("details[data-key]").forEach((d) => {
        if (keys.has(d.dataset.key)) d.open = true;
        if (closed.has(d.dataset.key)) d.open = false;
      });
    }
    state = next;
    controls.hidden = !state.running;
    const pending = state.pending;
    const box = document.getElementById("pending");
    const id = pending ? pending.episode_id + "#" + pending.cell : null;
    if (id !== shownPending) {
      shownPending = id;
      box.hidden = !pending;
      if (pending) {
        document.getElementById("pending-cell").textContent = String(pending.cell);
        document.getElementById("pending-reasons").textContent = (pending.reasons || []).join("; ");
        document.getElementById("pending-code").value = pending.code;
      }
    }
    document.body.dataset.status = state.status;
  }

  async function poll() {
    try {
      const answer = await fetch(here + "/state.json", { cache: "no-store" });
      if (answer.ok) {
        const next = await answer.json();
        const html = next.html;
        delete next.html;
        apply(next, html);
      }
    } catch (e) { /* the server may be restarting: try again */ }
    if (state.running) setTimeout(poll, 1500);
  }

  function value(id) { return document.getElementById(id).value; }

  async function act(kind) {
    const body = { sender: sender.value, reason: value("reason") };
    if (kind === "approve" || kind === "edit" || kind === "reject") {
      body.cell = state.pending ? state.pending.cell : null;
      if (kind === "edit") body.code = value("pending-code");
      if (kind === "reject") body.reason = value("reject-reason");
    } else if (kind === "hint") {
      body.text = value("hint-text");
    } else if (kind === "limits") {
      for (const name of ["max_iterations", "max_llm_calls", "max_model_calls", "max_tokens",
                          "max_cost_usd", "max_duration"]) {
        body[name] = value("limit-" + name);
      }
    } else if (kind === "cancel" && !confirm("Cancel this episode and its children?")) {
      return;
    }
    result.textContent = kind + "…";
    try {
      const answer = await fetch(here + "/act/" + kind, {
        method: "POST", headers: { "Content-Type": "application/json" }, body: JSON.stringify(body),
      });
      const outcome = await answer.json();
      result.textContent = outcome.error ? "error: " + outcome.error
        : (outcome.accepted ? "done: " : "refused: ") + outcome.message;
      result.dataset.outcome = outcome.accepted ? "accepted" : "refused";
      if (outcome.accepted && kind !== "hint" && kind !== "limits") shownPending = undefined;
    } catch (e) {
      result.textContent = "error: " + e;
    }
    if (!state.running) return;
    setTimeout(poll, 200);
  }

  controls.querySelectorAll("button[data-act]").forEach((button) => {
    button.addEventListener("click", () => act(button.dataset.act));
  });
  apply(state, undefined);
  if (state.running) setTimeout(poll, 1500);
})();
