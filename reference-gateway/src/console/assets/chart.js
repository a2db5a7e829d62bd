// The usage chart: prompt and completion tokens per day, from the JSON the page carries in
// #chart's data-series attribute (drawn with the vendored uPlot; the table works without it).
(function () {
  "use strict";
  function draw() {
    var el = document.getElementById("chart");
    if (!el || typeof uPlot === "undefined") return;
    var s;
    try { s = JSON.parse(el.getAttribute("data-series") || "{}"); } catch (e) { return; }
    if (!s.days || s.days.length === 0) { el.textContent = "No usage to chart in this window."; return; }
    var opts = {
      title: "Tokens per day (UTC)",
      width: Math.max(320, el.clientWidth - 16),
      height: 240,
      series: [{}, { label: "prompt tokens", stroke: "#2f5fd0", width: 2, points: { show: true } },
                   { label: "completion tokens", stroke: "#c2410c", width: 2, points: { show: true } }],
      axes: [{}, { size: 60 }],
    };
    el.setAttribute("data-drawn", "true");
    new uPlot(opts, [s.days, s.prompt_tokens, s.completion_tokens], el);
  }
  if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", draw); else draw();
})();
