// The operator console's one script (served from /assets/console.js; no inline script):
// the overview's live section refreshes itself every 2 s from /fragments/overview (not while
// the tab is hidden), and the
// failed page's "select all" box checks every row.
(function () {
  "use strict";
  var REFRESH_MS = 2000;

  function refreshLive() {
    var live = document.getElementById("live");
    if (!live) { return; }
    var url = live.getAttribute("data-fragment");
    function poll() {
      // A hidden tab does not poll (no load on the database for a page nobody sees); it
      // refreshes as soon as it is shown again.
      if (document.hidden) {
        document.addEventListener("visibilitychange", function shown() {
          if (!document.hidden) {
            document.removeEventListener("visibilitychange", shown);
            poll();
          }
        });
        return;
      }
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
