// The operator console's one script (served from /assets/console.js; no inline script):
// the overview's live section refreshes itself every 2 s from /fragments/overview, and the
// failed page's "select all" box checks every row.
(function () {
  "use strict";
  var REFRESH_MS = 2000;

  function refreshLive() {
    var live = document.getElementById("live");
    if (!live) { return; }
    var url = live.getAttribute("data-fragment");
    function poll() {
      fetch(url, { credentials: "same-origin", cache: "no-store" })
        .then(function (r) {
          if (!r.ok) { throw new Error("HTTP " + r.status); }
          return r.text();
        })
        .then(function (html) {
          // The fragment is the server's escaped HTML for this very section.
          live.innerHTML = html;
          live.classList.remove("stale-refresh");
        })
        .catch(function () { live.classList.add("stale-refresh"); })
        .then(function () { setTimeout(poll, REFRESH_MS); });
    }
    setTimeout(poll, REFRESH_MS);
  }

  function selectAll() {
    var all = document.getElementById("select-all");
    if (!all) { return; }
    all.addEventListener("change", function () {
      var boxes = document.querySelectorAll("#retry-form input[name=id]");
      for (var i = 0; i < boxes.length; i++) { boxes[i].checked = all.checked; }
    });
  }

  document.addEventListener("DOMContentLoaded", function () {
    refreshLive();
    selectAll();
  });
})();
