// The playground: streams a chat through POST /console/playground/chat (which calls the
// gateway's public API with the pasted key) and shows the tokens as they arrive and the billed
// usage from the last SSE chunk. The CSRF token comes from the form's data-csrf attribute.
(function () {
  "use strict";
  var form = document.getElementById("playground");
  if (!form) return;
  var out = document.getElementById("pg-output");
  var usageEl = document.getElementById("pg-usage");
  var errEl = document.getElementById("pg-error");
  form.addEventListener("submit", function (ev) {
    ev.preventDefault();
    out.textContent = ""; usageEl.textContent = ""; errEl.textContent = "";
    form.removeAttribute("data-done");
    var body = JSON.stringify({
      key: document.getElementById("pg-key").value,
      model: document.getElementById("pg-model").value,
      prompt: document.getElementById("pg-prompt").value,
      max_tokens: parseInt(document.getElementById("pg-max-tokens").value, 10) || 32,
    });
    fetch("/console/playground/chat", {
      method: "POST", credentials: "same-origin", body: body,
      headers: { "content-type": "application/json", "x-csrf-token": form.getAttribute("data-csrf") },
    }).then(function (resp) {
      if (!resp.ok || !resp.body) {
        return resp.text().then(function (t) {
          var m = t;
          try { m = JSON.parse(t).error.message; } catch (e) { m = "HTTP " + resp.status; }
          throw new Error(m);
        });
      }
      var requestId = resp.headers.get("x-request-id") || "";
      var reader = resp.body.getReader();
      var decoder = new TextDecoder();
      var buf = "";
      function handle(line) {
        if (line.indexOf("data:") !== 0) return;
        var data = line.slice(5).trim();
        if (data === "[DONE]") return;
        var chunk;
        try { chunk = JSON.parse(data); } catch (e) { return; }
        if (chunk.error) { errEl.textContent = chunk.error.message || "error"; return; }
        (chunk.choices || []).forEach(function (c) {
          if (c.delta && c.delta.content) out.textContent += c.delta.content;
        });
        if (chunk.usage) {
          usageEl.textContent = "Billed: " + chunk.usage.prompt_tokens + " prompt + " +
            chunk.usage.completion_tokens + " completion tokens · request " + requestId;
          usageEl.setAttribute("data-prompt-tokens", chunk.usage.prompt_tokens);
          usageEl.setAttribute("data-completion-tokens", chunk.usage.completion_tokens);
          usageEl.setAttribute("data-request-id", requestId);
        }
      }
      function pump() {
        return reader.read().then(function (r) {
          if (r.done) { form.setAttribute("data-done", "true"); return; }
          buf += decoder.decode(r.value, { stream: true });
          var lines = buf.split(/\r?\n/);
          buf = lines.pop();
          lines.forEach(handle);
          return pump();
        });
      }
      return pump();
    }).catch(function (e) {
      errEl.textContent = e.message;
      form.setAttribute("data-done", "error");
    });
  });
})();
