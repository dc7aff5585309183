// The chat page's logic: keeps the conversation as OpenAI messages, sends it to this server's
// /v1/chat/completions with stream: true, and draws each delta as it comes (answer, Qwen3 reasoning, tool calls).
"use strict";

const $ = (id) => document.getElementById(id);
let history = [];        // the conversation, without the system prompt (read from its field on each send)
let pendingImages = [];  // data: URLs to go with the next user message
let controller = null;   // the running answer's AbortController

// Settings survive a reload; the API key stays in this browser's localStorage and goes only to this server.
for (const el of document.querySelectorAll("[data-store]")) {
  const key = `slotserve.${el.id}`;
  const saved = localStorage.getItem(key);
  if (saved !== null) el.value = saved;
  el.addEventListener("input", () => localStorage.setItem(key, el.value));
}

function headers() {
  const key = $("api-key").value.trim();
  return {"Content-Type": "application/json", ...(key ? {Authorization: `Bearer ${key}`} : {})};
}

function element(tag, className, text) {
  const el = document.createElement(tag);
  if (className) el.className = className;
  if (text !== undefined) el.textContent = text;  // text, never HTML: model output is not trusted markup
  return el;
}

function bubble(role) {
  const el = element("div", `msg ${role}`);
  $("messages").append(el);
  return el;
}

function showError(where, message) {
  where.append(element("div", "error", message));
  where.scrollIntoView({block: "end"});
}

// "401 AuthenticationError: missing or invalid API key" from an OpenAI error body, else the raw status and text.
function describe(error) {
  return `${error.code ?? ""} ${error.type ?? "error"}: ${error.message}`.trim();
}

async function httpError(response) {
  const text = await response.text();
  try {
    const error = JSON.parse(text).error;
    if (error?.message) return describe(error);
  } catch {
    // not JSON (a proxy's page, say): shown as it is below
  }
  return `${response.status} ${response.statusText} ${text}`.trim();
}

// The model's name, and whether it takes images (the server's `input_modalities`). Without the key this is a
// 401: the page says so, and asks again once a key is typed.
async function loadModel() {
  const notice = $("notice");
  try {
    const response = await fetch("v1/models", {headers: headers()});
    if (!response.ok) {
      notice.textContent = response.status === 401
        ? "This server needs an API key: enter it under Settings." : await httpError(response);
      return;
    }
    const model = (await response.json()).data[0];
    notice.textContent = "";
    $("model").textContent = model.id;
    $("image-label").hidden = !(model.input_modalities ?? []).includes("image");
  } catch (e) {
    notice.textContent = `The server does not answer: ${e.message}`;
  }
}

// Each `data:` payload of a server-sent event stream read through fetch, parsed, until `[DONE]`.
async function* events(body) {
  const reader = body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const {value, done} = await reader.read();
    if (done) throw new Error("the connection closed before the answer finished");
    buffer += value;
    const blocks = buffer.split(/\r?\n\r?\n/);
    buffer = blocks.pop();  // an event not yet complete
    for (const block of blocks) {
      const data = block.split(/\r?\n/).filter((line) => line.startsWith("data:"))
        .map((line) => line.slice(5).replace(/^ /, "")).join("\n");
      if (data === "[DONE]") return;
      if (data) yield JSON.parse(data);
    }
  }
}

function userBubble(text, images) {
  const el = bubble("user");
  el.append(element("div", "content", text));
  for (const url of images) el.append(Object.assign(element("img", "thumb"), {src: url, alt: "attached image"}));
  return el;
}

// An answer's bubble: reasoning (collapsible), text and tool calls, each drawn only once it has something.
function answerView() {
  const el = bubble("assistant");
  const reasoning = element("details", "reasoning");
  reasoning.hidden = reasoning.open = true;
  reasoning.append(element("summary", "", "Reasoning"), element("div", "text"));
  const content = element("div", "content");
  const tools = element("div", "tool-calls");
  el.append(reasoning, content, tools);
  return {
    el,
    draw(answer) {
      reasoning.hidden = !answer.reasoning;
      reasoning.lastChild.textContent = answer.reasoning;
      if (answer.content && !content.textContent) reasoning.open = false;  // out of the way once the answer starts
      content.textContent = answer.content;
      tools.replaceChildren(...answer.toolCalls.map((call) =>
        element("div", "tool-call", `${call.function.name}(${call.function.arguments})`)));
      el.scrollIntoView({block: "end"});
    },
  };
}

function addDelta(answer, delta) {
  answer.content += delta.content ?? "";
  answer.reasoning += delta.reasoning_content ?? "";
  for (const call of delta.tool_calls ?? []) {  // streamed in pieces, keyed by index
    const slot = answer.toolCalls[call.index] ??= {id: "", type: "function", function: {name: "", arguments: ""}};
    slot.id = call.id ?? slot.id;
    slot.function.name += call.function?.name ?? "";
    slot.function.arguments += call.function?.arguments ?? "";
  }
}

function extraFields() {
  const text = $("extra").value.trim();
  if (!text) return {};
  let fields;
  try {
    fields = JSON.parse(text);
  } catch (e) {
    throw new Error(`Extra request fields: ${e.message}`);
  }
  if (fields === null || typeof fields !== "object" || Array.isArray(fields)) {
    throw new Error("Extra request fields: give a JSON object");
  }
  return fields;
}

function numberField(id) {
  const value = $(id).value.trim();
  return value === "" ? undefined : Number(value);  // undefined: left out, the server's default
}

function setBusy(busy) {
  $("send").disabled = busy;
  $("stop").disabled = !busy;
  document.body.dataset.state = busy ? "streaming" : "idle";  // for styles, and for tests to wait on
}

async function send() {
  const text = $("prompt").value.trim();
  if (controller || (!text && !pendingImages.length)) return;
  let extra;
  try {
    extra = extraFields();
  } catch (e) {
    showError(bubble("notice"), e.message);
    return;
  }
  const images = pendingImages;
  const content = images.length
    ? [{type: "text", text}, ...images.map((url) => ({type: "image_url", image_url: {url}}))] : text;
  const turn = {role: "user", content};
  const conversation = history;  // "New chat" mid-answer starts another; this answer stays with its own
  conversation.push(turn);
  const sent = userBubble(text, images);
  $("prompt").value = "";
  setImages([]);

  const system = $("system").value.trim();
  const body = {
    messages: system ? [{role: "system", content: system}, ...conversation] : conversation,
    temperature: numberField("temperature"),
    max_tokens: numberField("max-tokens"),
    ...extra,
    stream: true,  // after the extra fields: this page reads only streams
  };
  const answer = {content: "", reasoning: "", toolCalls: []};
  const view = answerView();
  controller = new AbortController();
  setBusy(true);
  try {
    const response = await fetch("v1/chat/completions", {
      method: "POST", headers: headers(), body: JSON.stringify(body), signal: controller.signal});
    if (!response.ok) throw new Error(await httpError(response));
    for await (const chunk of events(response.body)) {
      if (chunk.error) throw new Error(describe(chunk.error));  // an error after the stream started
      const delta = chunk.choices?.[0]?.delta;
      if (delta) {
        addDelta(answer, delta);
        view.draw(answer);
      }
    }
  } catch (e) {
    if (e.name === "AbortError") view.el.append(element("div", "stopped", "stopped"));
    else showError(view.el, e.message);
  } finally {
    controller = null;
    setBusy(false);
  }
  if (answer.content || answer.reasoning || answer.toolCalls.length) {
    // Kept, even when stopped or cut short, so the next turn follows what was shown.
    const calls = answer.toolCalls.length ? {tool_calls: answer.toolCalls} : {};
    conversation.push({role: "assistant", content: answer.content, ...calls});
  } else {
    // Nothing came back: the turn is taken out, its text put back to send again (after entering a key, say).
    conversation.pop();
    sent.classList.add("unsent");
    $("prompt").value ||= text;
    setImages(images);
  }
}

function setImages(urls) {
  pendingImages = urls;
  $("attachments").replaceChildren(...urls.map((url, i) => {
    const thumb = Object.assign(element("img", "thumb"), {src: url, alt: "attached image", title: "click to remove"});
    thumb.addEventListener("click", () => setImages(pendingImages.filter((_, j) => j !== i)));
    return thumb;
  }));
}

function readAsDataURL(file) {
  return new Promise((resolve, reject) => {
    const reader = new FileReader();
    reader.onload = () => resolve(reader.result);
    reader.onerror = () => reject(reader.error);
    reader.readAsDataURL(file);
  });
}

$("image").addEventListener("change", async (event) => {
  const urls = await Promise.all([...event.target.files].map(readAsDataURL));
  setImages([...pendingImages, ...urls]);
  event.target.value = "";  // the same file can be picked again
});

$("composer").addEventListener("submit", (event) => {
  event.preventDefault();
  send();
});
$("prompt").addEventListener("keydown", (event) => {
  if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
    event.preventDefault();
    $("composer").requestSubmit();
  }
});
$("stop").addEventListener("click", () => controller?.abort());
$("new-chat").addEventListener("click", () => {
  controller?.abort();
  history = [];
  setImages([]);
  $("messages").replaceChildren();
  $("prompt").focus();
});
$("api-key").addEventListener("change", loadModel);

setBusy(false);
loadModel();
