// Engram admin console: the few things that need a script. Every page works without it
// (forms post normally); with it, uploads show per-file progress, chat answers stream, and
// live sections refresh. No dependencies, no external requests.
(function () {
  "use strict";
  var csrf = (document.querySelector('meta[name="csrf-token"]') || {}).content || "";

  // A notice (?ok=...) shows once: the address drops it, so a reload does not repeat it.
  if (window.history && history.replaceState && /[?&]ok=/.test(location.search)) {
    var params = new URLSearchParams(location.search);
    params.delete("ok");
    var rest = params.toString();
    history.replaceState(null, "", location.pathname + (rest ? "?" + rest : "") + location.hash);
  }

  // A field with a rule (a pattern and a title) states the rule in the page's language when
  // its value breaks it, instead of the browser's own "Please match the requested format.".
  document.querySelectorAll("input[pattern][title]").forEach(function (input) {
    input.addEventListener("invalid", function () {
      if (input.validity.patternMismatch) input.setCustomValidity(input.title);
    });
    input.addEventListener("input", function () { input.setCustomValidity(""); });
  });

  // Copy buttons: <button data-copy="ID" data-copied="label"> copies the element's text. The
  // clipboard API needs a secure context (HTTPS or localhost); over plain HTTP the text is
  // selected and copied the old way.
  document.querySelectorAll("button[data-copy]").forEach(function (b) {
    b.addEventListener("click", function () {
      var el = document.getElementById(b.getAttribute("data-copy"));
      var text = el.textContent.trim();
      var done = function () { b.textContent = b.getAttribute("data-copied"); };
      var fallback = function () {
        var range = document.createRange();
        range.selectNodeContents(el);
        var sel = window.getSelection();
        sel.removeAllRanges();
        sel.addRange(range);
        if (document.execCommand("copy")) done();
      };
      if (navigator.clipboard && window.isSecureContext) navigator.clipboard.writeText(text).then(done, fallback);
      else fallback();
    });
  });

  // Irreversible actions (revoking a key, deleting a user) ask first: <form data-confirm="...">.
  document.querySelectorAll("form[data-confirm]").forEach(function (f) {
    f.addEventListener("submit", function (e) {
      if (!window.confirm(f.getAttribute("data-confirm"))) e.preventDefault();
    });
  });

  // Live sections: <section id="x" data-live="SECONDS"> is re-fetched from this page's URL
  // and replaced, while the tab is visible and nothing in it has focus.
  function live(el) {
    var secs = parseInt(el.getAttribute("data-live"), 10);
    if (!secs || !el.id) return;
    setTimeout(function () {
      if (document.hidden || el.contains(document.activeElement)) return live(el);
      fetch(location.href, { credentials: "same-origin", headers: { "X-Engram-Live": "1" } })
        .then(function (r) { return r.ok ? r.text() : Promise.reject(r.status); })
        .then(function (html) {
          var fresh = new DOMParser().parseFromString(html, "text/html").getElementById(el.id);
          if (!fresh) return;
          el.replaceWith(fresh);
          live(fresh);
        })
        .catch(function () { live(el); });
    }, secs * 1000);
  }
  document.querySelectorAll("[data-live]").forEach(live);

  // Uploads: drag and drop onto the zone, then one request per file with its own progress.
  var form = document.getElementById("upload-form");
  if (form) {
    var input = document.getElementById("upload-files");
    var zone = document.getElementById("dropzone");
    var list = document.getElementById("upload-progress");
    ["dragenter", "dragover"].forEach(function (t) {
      zone.addEventListener(t, function (e) { e.preventDefault(); zone.classList.add("over"); });
    });
    ["dragleave", "drop"].forEach(function (t) {
      zone.addEventListener(t, function (e) { e.preventDefault(); zone.classList.remove("over"); });
    });
    zone.addEventListener("drop", function (e) {
      if (e.dataTransfer && e.dataTransfer.files.length) input.files = e.dataTransfer.files;
    });
    form.addEventListener("submit", function (e) {
      if (!window.FormData || !input.files.length) return;
      e.preventDefault();
      var files = Array.prototype.slice.call(input.files);
      var failed = 0;
      list.textContent = "";
      form.querySelector("button[type=submit]").disabled = true;
      var next = function (i) {
        if (i === files.length) {
          if (!failed) {
            location.href = location.pathname + "?ok=flash.uploaded";
            return;
          }
          // A refused file's reason stays on the page (a redirect would take it away); the
          // document list refreshes with the files that were taken.
          var note = document.createElement("li");
          note.className = "flash error";
          note.setAttribute("role", "alert");
          note.textContent = form.getAttribute("data-partial");
          list.appendChild(note);
          form.querySelector("button[type=submit]").disabled = false;
          input.value = "";
          fetch(location.href, { credentials: "same-origin" })
            .then(function (r) { return r.text(); })
            .then(function (html) {
              var page = new DOMParser().parseFromString(html, "text/html");
              ["docs", "kb-settings"].forEach(function (id) {
                var el = document.getElementById(id), fresh = page.getElementById(id);
                if (el && fresh) { el.replaceWith(fresh); live(fresh); }
              });
            });
          return;
        }
        var f = files[i];
        var li = document.createElement("li");
        var name = document.createElement("span");
        name.textContent = f.name;
        var bar = document.createElement("progress");
        bar.max = 100;
        bar.value = 0;
        var state = document.createElement("span");
        state.className = "muted";
        state.textContent = "0 %";
        li.append(name, bar, state);
        list.appendChild(li);
        var body = new FormData();
        body.append("csrf", csrf);
        body.append("file", f, f.name);
        var xhr = new XMLHttpRequest();
        xhr.open("POST", form.action);
        xhr.setRequestHeader("Accept", "application/json");
        xhr.setRequestHeader("X-CSRF-Token", csrf);
        xhr.upload.onprogress = function (ev) {
          if (ev.lengthComputable) {
            bar.value = Math.round((ev.loaded / ev.total) * 100);
            state.textContent = bar.value + " %";
          }
        };
        xhr.onload = function () {
          var outcome = "failed";
          try {
            var d = JSON.parse(xhr.responseText).documents[0];
            outcome = d.outcome + (d.reason ? ": " + d.reason : "");
            if (d.outcome === "failed") failed++;
          } catch (err) {
            failed++;
            outcome = "HTTP " + xhr.status;
          }
          bar.value = 100;
          state.textContent = outcome;
          li.setAttribute("data-outcome", outcome);
          next(i + 1);
        };
        xhr.onerror = function () { failed++; state.textContent = "error"; next(i + 1); };
        xhr.send(body);
      };
      next(0);
    });
  }

  // Restore: the archive as the request body (streamed by the server, however large), the
  // CSRF token in a header. Without the script the form posts multipart, up to the upload limit.
  var restore = document.getElementById("restore-form");
  if (restore) {
    restore.addEventListener("submit", function (e) {
      var file = document.getElementById("restore-file").files[0];
      if (!file) return;
      e.preventDefault();
      var bar = document.getElementById("restore-progress");
      bar.hidden = false;
      restore.querySelector("button[type=submit]").disabled = true;
      var xhr = new XMLHttpRequest();
      xhr.open("POST", restore.action);
      xhr.setRequestHeader("X-CSRF-Token", csrf);
      xhr.setRequestHeader("Content-Type", "application/zstd");
      xhr.upload.onprogress = function (ev) {
        if (ev.lengthComputable) bar.value = Math.round((ev.loaded / ev.total) * 100);
      };
      xhr.onload = function () {
        if (xhr.status < 400) {
          location.href = "/console/settings?ok=flash.restore_staged";
        } else {
          document.open();
          document.write(xhr.responseText);
          document.close();
        }
      };
      xhr.onerror = function () { restore.querySelector("button[type=submit]").disabled = false; };
      xhr.send(file);
    });
  }

  // Chat: stream the answer from /console/chat/stream (server-sent events over fetch).
  var chat = document.getElementById("chat-form");
  if (chat && window.ReadableStream && window.TextDecoder) {
    chat.addEventListener("submit", function (e) {
      e.preventDefault();
      var answer = document.getElementById("answer");
      var cites = document.getElementById("citations");
      var errBox = document.getElementById("answer-error");
      var status = document.getElementById("answer-status");
      var button = document.getElementById("chat-submit");
      answer.textContent = "";
      cites.textContent = "";
      errBox.hidden = true;
      status.textContent = "";
      document.querySelectorAll("#timings tr[data-field] td").forEach(function (td) { td.textContent = "–"; });
      answer.classList.add("streaming");
      button.disabled = true;
      var finish = function () { answer.classList.remove("streaming"); button.disabled = false; };
      var handle = function (event, data) {
        var d = JSON.parse(data);
        if (event === "token") {
          answer.textContent += d.text;
        } else if (event === "citations") {
          d.forEach(function (c) {
            var li = document.createElement("li");
            var a = document.createElement("a");
            a.href = c.href;
            a.textContent = "[" + c.n + "] " + c.doc_name;
            var meta = document.createElement("span");
            meta.className = "muted small";
            meta.textContent = " " + c.collection + " · " + c.score.toFixed(4);
            li.append(a, meta);
            cites.appendChild(li);
          });
        } else if (event === "timings") {
          document.querySelectorAll("#timings tr[data-field]").forEach(function (tr) {
            var f = tr.getAttribute("data-field");
            var v = d[f];
            var td = tr.querySelector("td");
            if (f === "kv_chunks" && v) td.textContent = "DRAM " + v.dram + " · NVMe " + v.nvme + " · ↻ " + v.computed;
            else if (typeof v === "number") td.textContent = f.slice(-3) === "_ms" ? v.toFixed(1) + " ms" : String(v);
          });
        } else if (event === "done") {
          // "none": no passage was about the question, and no policy ran.
          status.textContent = d.policy === "none" ? chat.getAttribute("data-no-passages") : d.policy + " · " + d.finish_reason;
          answer.setAttribute("data-done", "1");
        } else if (event === "error") {
          errBox.textContent = (d.error && d.error.message) || data;
          errBox.hidden = false;
        }
      };
      fetch("/console/chat/stream", {
        method: "POST",
        credentials: "same-origin",
        headers: { "Content-Type": "application/x-www-form-urlencoded", "X-CSRF-Token": csrf },
        body: new URLSearchParams(new FormData(chat)),
      }).then(function (res) {
        if (!res.ok) throw new Error("HTTP " + res.status);
        var reader = res.body.getReader();
        var dec = new TextDecoder();
        var buf = "";
        var pump = function () {
          return reader.read().then(function (r) {
            if (r.done) return finish();
            buf += dec.decode(r.value, { stream: true });
            var at;
            while ((at = buf.indexOf("\n\n")) >= 0) {
              var block = buf.slice(0, at);
              buf = buf.slice(at + 2);
              var ev = "message", data = [];
              block.split("\n").forEach(function (line) {
                if (line.indexOf("event:") === 0) ev = line.slice(6).trim();
                else if (line.indexOf("data:") === 0) data.push(line.slice(5).replace(/^ /, ""));
              });
              if (data.length) handle(ev, data.join("\n"));
            }
            return pump();
          });
        };
        return pump();
      }).catch(function (err) {
        errBox.textContent = String(err);
        errBox.hidden = false;
        finish();
      });
    });
  }
})();
