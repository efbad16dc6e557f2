// memfuse console: the only script. A page that shows a store carries data-live (the URL of
// the store's server-sent events); when the store changes, the page reloads, or, on an edit
// page (data-live-mode="notice"), a notice appears instead so typed text is never lost.
// Once a form is being submitted, or the page is being left (a link followed, an address
// typed: beforeunload), the page no longer reloads: a reload then would cancel that
// navigation and keep the person on this page.
// Without JavaScript every page has a plain Refresh link.
(function () {
  "use strict";
  var body = document.body;
  var url = body.getAttribute("data-live");
  if (!url || !window.EventSource) { return; }
  var mode = body.getAttribute("data-live-mode") || "reload";
  var source = new EventSource(url);
  var leaving = false;
  function stop() { leaving = true; source.close(); }
  document.addEventListener("submit", stop, true);
  window.addEventListener("beforeunload", stop);
  window.addEventListener("pagehide", stop);
  source.addEventListener("change", function () {
    if (leaving) { return; }
    if (mode === "notice") {
      var notice = document.querySelector(".live-notice");
      if (notice) {
        notice.textContent = "This record changed since you opened the editor. Saving will show what changed and keep your text.";
        notice.hidden = false;
      }
      source.close();
      return;
    }
    stop();
    window.location.reload();
  });
  source.addEventListener("gone", function () { source.close(); });
})();
