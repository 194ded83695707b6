// Live refresh for pages marked <body data-live="SECONDS">: fetch the same page again and swap
// the contents of <main id="live">. No third-party code; pauses while the tab is hidden.
(function () {
  "use strict";
  var seconds = Number(document.body.dataset.live || 0);
  if (!seconds) { return; }
  function refresh() {
    if (document.hidden) { return; }
    fetch(window.location.href, { credentials: "same-origin", headers: { "X-Live": "1" } })
      .then(function (r) { return r.ok ? r.text() : null; })
      .then(function (html) {
        if (!html) { return; }
        var doc = new DOMParser().parseFromString(html, "text/html");
        var fresh = doc.getElementById("live");
        var main = document.getElementById("live");
        if (fresh && main) { main.replaceChildren.apply(main, Array.from(fresh.childNodes)); }
      })
      .catch(function () { /* the next tick tries again */ });
  }
  window.setInterval(refresh, seconds * 1000);
})();
