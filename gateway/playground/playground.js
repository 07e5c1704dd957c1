// Switchyard playground: plain JavaScript, no framework, nothing loaded from elsewhere.
// It talks to this gateway's own /v1/models and /v1/chat/completions. Streams are read
// with fetch + ReadableStream (EventSource cannot POST) and parsed as Server-Sent Events.
"use strict";

(function () {
  const KEY_STORAGE = "switchyard.playground.apiKey";
  const MODEL_STORAGE = "switchyard.playground.model";

  const $ = (id) => document.getElementById(id);
  const els = {
    key: $("api-key"), forgetKey: $("forget-key"),
    model: $("model"), reloadModels: $("reload-models"), modelStatus: $("model-status"),
    system: $("system-prompt"), temperature: $("temperature"), topP: $("top-p"),
    maxTokens: $("max-tokens"),
    log: $("log"), empty: $("empty-log"), error: $("error"),
    chat: $("chat"), message: $("message"), send: $("send"), stop: $("stop"),
    clear: $("clear"),
  };

  // The conversation sent with each request: completed exchanges only.
  let history = [];
  let controller = null;

  // ---- storage (sessionStorage only: the key dies with the tab) ----

  function storageGet(name) {
    try { return window.sessionStorage.getItem(name) || ""; } catch (e) { return ""; }
  }
  function storageSet(name, value) {
    try {
      if (value) window.sessionStorage.setItem(name, value);
      else window.sessionStorage.removeItem(name);
    } catch (e) { /* storage disabled: the key lives in the field only */ }
  }

  function headers() {
    const h = { "Content-Type": "application/json", "Accept": "application/json" };
    const key = els.key.value.trim();
    if (key) h["Authorization"] = "Bearer " + key;
    return h;
  }

  // ---- errors, as the server sent them ----

  // An OpenAI error body {"error": {message, type, param, code}}, TGI's
  // {"error": "...", "error_type": "..."}, or anything else the server answered.
  function describeError(body, status, text) {
    const parts = [];
    if (status) parts.push("HTTP " + status);
    let message = "";
    let code = "";
    let param = "";
    if (body && typeof body.error === "object" && body.error !== null) {
      message = String(body.error.message || "");
      code = body.error.code || body.error.type || "";
      param = body.error.param || "";
    } else if (body && typeof body.error === "string") {
      message = body.error;
      code = body.error_type || "";
    } else if (body && body.detail !== undefined) {
      message = typeof body.detail === "string" ? body.detail : JSON.stringify(body.detail);
    } else {
      message = (text || "").trim() || "(empty answer)";
    }
    if (code) parts.push(String(code));
    let line = parts.join(" ") + ": " + message;
    if (param) line += " (param: " + param + ")";
    return { message: message, code: String(code || ""), status: status || null, text: line };
  }

  async function errorFromResponse(response) {
    const text = await response.text().catch(() => "");
    let body = null;
    try { body = JSON.parse(text); } catch (e) { body = null; }
    const err = describeError(body, response.status, text);
    const retry = response.headers.get("Retry-After");
    if (retry) err.text += " (retry after " + retry + " s)";
    return err;
  }

  function showError(err) {
    els.error.textContent = err.text;
    els.error.dataset.status = err.status === null ? "" : String(err.status);
    els.error.dataset.code = err.code || "";
    els.error.hidden = false;
  }
  function clearError() {
    els.error.hidden = true;
    els.error.textContent = "";
    delete els.error.dataset.status;
    delete els.error.dataset.code;
  }

  // ---- models ----

  async function loadModels() {
    els.modelStatus.textContent = "Loading models\u2026";
    let response;
    try {
      response = await fetch("/v1/models", { headers: headers(), cache: "no-store" });
    } catch (e) {
      const err = { text: "Network error: " + e.message, status: null, code: "" };
      els.modelStatus.textContent = "Could not load the models.";
      showError(err);
      return;
    }
    if (!response.ok) {
      const err = await errorFromResponse(response);
      els.modelStatus.textContent = "Could not load the models.";
      showError(err);  // the options already listed stay, to try again
      return;
    }
    const body = await response.json();
    const ids = (body.data || []).map((m) => m.id).sort();
    const wanted = els.model.value || storageGet(MODEL_STORAGE);
    els.model.replaceChildren(...ids.map((id) => new Option(id, id)));
    if (ids.includes(wanted)) els.model.value = wanted;
    els.modelStatus.textContent = ids.length === 1 ? "1 model served."
      : ids.length + " models served.";
    clearError();
  }

  // ---- the log ----

  function addMessage(role, text) {
    els.empty.hidden = true;
    const article = document.createElement("article");
    article.className = "msg " + role;
    const label = document.createElement("p");
    label.className = "role";
    label.textContent = role === "user" ? "You" : "Assistant";
    const content = document.createElement("p");
    content.className = "content";
    content.textContent = text;
    article.append(label, content);
    els.log.append(article);
    els.log.scrollTop = els.log.scrollHeight;
    return { article: article, content: content };
  }

  function addNote(article, className, text) {
    const p = document.createElement("p");
    p.className = className;
    p.textContent = text;
    article.append(p);
    return p;
  }

  // ---- the request ----

  function numberField(input, parse) {
    const raw = input.value.trim();
    if (raw === "") return undefined;
    const value = parse(raw);
    return Number.isFinite(value) ? value : undefined;
  }

  function requestBody(messages) {
    const body = {
      model: els.model.value,
      messages: messages,
      stream: true,
      stream_options: { include_usage: true },
    };
    const temperature = numberField(els.temperature, parseFloat);
    const topP = numberField(els.topP, parseFloat);
    const maxTokens = numberField(els.maxTokens, (s) => parseInt(s, 10));
    if (temperature !== undefined) body.temperature = temperature;
    if (topP !== undefined) body.top_p = topP;
    if (maxTokens !== undefined) body.max_tokens = maxTokens;
    return body;
  }

  // Server-Sent Events from a fetch body: yields {event, data} per event.
  async function* sseEvents(body) {
    const reader = body.getReader();
    const decoder = new TextDecoder();
    let buffer = "";
    try {
      for (;;) {
        const { value, done } = await reader.read();
        buffer += decoder.decode(value || new Uint8Array(), { stream: !done });
        // CRLF or CR line ends as LF (a CR last in the buffer waits: an LF may follow)
        buffer = buffer.replace(done ? /\r\n?/g : /\r\n|\r(?!$)/g, "\n");
        let cut;
        while ((cut = buffer.indexOf("\n\n")) >= 0) {
          const block = buffer.slice(0, cut);
          buffer = buffer.slice(cut + 2);
          const event = parseEvent(block);
          if (event) yield event;
        }
        if (done) {
          const event = parseEvent(buffer);
          if (event) yield event;
          return;
        }
      }
    } finally {
      reader.releaseLock();
    }
  }

  function parseEvent(block) {
    let name = "message";
    const data = [];
    for (const line of block.split("\n")) {
      if (line === "" || line.startsWith(":")) continue;
      const colon = line.indexOf(":");
      const field = colon < 0 ? line : line.slice(0, colon);
      let value = colon < 0 ? "" : line.slice(colon + 1);
      if (value.startsWith(" ")) value = value.slice(1);
      if (field === "data") data.push(value);
      else if (field === "event") name = value;
    }
    return data.length ? { event: name, data: data.join("\n") } : null;
  }

  function formatStats(timing, usage, chunks) {
    const parts = [];
    if (timing.first !== null) {
      const ttft = timing.first - timing.start;
      parts.push("TTFT " + Math.round(ttft) + " ms");
    }
    const tokens = usage ? usage.completion_tokens : chunks;
    // Decode speed: tokens after the first over the time after the first; with one token
    // (or all at once) the whole answer over the whole request.
    let rate = null;
    const decodeMs = timing.first !== null ? timing.last - timing.first : 0;
    if (tokens > 1 && decodeMs > 0) rate = (tokens - 1) / (decodeMs / 1000);
    else if (tokens > 0) rate = tokens / (Math.max(timing.end - timing.start, 1) / 1000);
    if (rate !== null) parts.push(rate.toFixed(1) + " tok/s");
    parts.push((usage ? "" : "~") + tokens + (tokens === 1 ? " token" : " tokens"));
    if (usage) parts.push("prompt " + usage.prompt_tokens);
    return {
      text: parts.join(" \u00b7 "),
      ttftMs: timing.first === null ? "" : String(Math.round(timing.first - timing.start)),
      rate: rate === null ? "" : rate.toFixed(1),
    };
  }

  function setBusy(busy) {
    els.send.disabled = busy;
    els.stop.disabled = !busy;
    els.chat.setAttribute("aria-busy", busy ? "true" : "false");
  }

  async function send(text) {
    clearError();
    if (!els.model.value) {
      showError({ text: "Pick a model first (enter the API key, then Reload).", status: null,
                  code: "" });
      return;
    }
    const messages = [];
    const system = els.system.value.trim();
    if (system) messages.push({ role: "system", content: system });
    messages.push(...history, { role: "user", content: text });

    addMessage("user", text);
    const answer = addMessage("assistant", "");
    answer.article.setAttribute("aria-busy", "true");
    setBusy(true);
    controller = new AbortController();

    const timing = { start: performance.now(), first: null, last: null, end: null };
    let usage = null;
    let chunks = 0;
    let failed = null;
    let stopped = false;
    let finish = null;
    try {
      const response = await fetch("/v1/chat/completions", {
        method: "POST", headers: headers(), body: JSON.stringify(requestBody(messages)),
        signal: controller.signal, cache: "no-store",
      });
      if (!response.ok) {
        failed = await errorFromResponse(response);
      } else {
        for await (const event of sseEvents(response.body)) {
          if (event.data === "[DONE]") break;
          let chunk;
          try { chunk = JSON.parse(event.data); } catch (e) {
            failed = { text: "Unreadable event from the server: " + event.data, status: null,
                       code: "" };
            break;
          }
          if (event.event === "error" || chunk.error) {  // an error after the stream began
            failed = describeError(chunk, null, event.data);
            break;
          }
          if (chunk.usage) usage = chunk.usage;
          for (const choice of chunk.choices || []) {
            const piece = choice.delta && choice.delta.content;
            if (piece) {
              const now = performance.now();
              if (timing.first === null) timing.first = now;
              timing.last = now;
              chunks += 1;
              answer.content.textContent += piece;
              els.log.scrollTop = els.log.scrollHeight;
            }
            if (choice.finish_reason) finish = choice.finish_reason;
          }
        }
      }
    } catch (e) {
      if (e.name === "AbortError") stopped = true;
      else failed = { text: "Network error: " + e.message, status: null, code: "" };
    } finally {
      timing.end = performance.now();
      controller = null;
      setBusy(false);
      answer.article.removeAttribute("aria-busy");
    }

    if (failed) {
      addNote(answer.article, "msg-error", failed.text);
      showError(failed);
      if (!els.message.value) els.message.value = text;  // to retry
      return;
    }
    if (timing.first !== null || usage) {
      const stats = formatStats(timing, usage, chunks);
      const p = addNote(answer.article, "stats", stats.text);
      p.dataset.ttftMs = stats.ttftMs;
      p.dataset.tokensPerSecond = stats.rate;
    }
    if (stopped) addNote(answer.article, "stats", "Stopped.");
    else if (finish === "length") addNote(answer.article, "stats", "Cut at max tokens.");
    if (answer.content.textContent) {
      history.push({ role: "user", content: text },
                   { role: "assistant", content: answer.content.textContent });
    }
  }

  // ---- wiring ----

  els.key.value = storageGet(KEY_STORAGE);
  els.key.addEventListener("input", () => storageSet(KEY_STORAGE, els.key.value.trim()));
  els.key.addEventListener("change", loadModels);
  els.forgetKey.addEventListener("click", () => {
    els.key.value = "";
    storageSet(KEY_STORAGE, "");
    els.key.focus();
  });
  els.reloadModels.addEventListener("click", loadModels);
  els.model.addEventListener("change", () => storageSet(MODEL_STORAGE, els.model.value));
  document.getElementById("settings").addEventListener("submit", (e) => e.preventDefault());

  els.chat.addEventListener("submit", (e) => {
    e.preventDefault();
    if (controller) return;
    const text = els.message.value.trim();
    if (!text) { els.message.focus(); return; }
    els.message.value = "";
    send(text);
  });
  els.message.addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey && !e.isComposing) {
      e.preventDefault();
      els.chat.requestSubmit();
    }
  });
  els.stop.addEventListener("click", () => { if (controller) controller.abort(); });
  els.clear.addEventListener("click", () => {
    history = [];
    for (const node of els.log.querySelectorAll(".msg")) node.remove();
    els.empty.hidden = false;
    clearError();
  });

  loadModels();
})();
