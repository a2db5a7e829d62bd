// The console's charts: every element with class "chart" carries its data as JSON in its
// data-series attribute ({title, days: [unix seconds], series: [{label, values}]}) and is
// drawn with the vendored uPlot; the tables beside them work without it.
(function () {
  "use strict";
  var colors = ["#2f5fd0", "#c2410c", "#15803d", "#7c3aed"];
  function drawOne(el) {
    var s;
    try { s = JSON.parse(el.getAttribute("data-series") || "{}"); } catch (e) { return; }
    if (!s.days || s.days.length === 0 || !s.series) { el.textContent = "Nothing to chart in this window."; return; }
    var series = [{}], data = [s.days];
    s.series.forEach(function (x, i) {
      series.push({ label: x.label, stroke: colors[i % colors.length], width: 2, points: { show: true } });
      data.push(x.values);
    });
    // credits are small numbers: uPlot's own labels would round them all to 0
    var label = function (u, splits) { return splits.map(function (v) { return v == null ? "" : String(+v.toPrecision(6)); }); };
    var opts = { title: s.title, width: Math.max(320, el.clientWidth - 16), height: 240, series: series,
                 axes: [{}, { size: 80, values: label }] };
    el.setAttribute("data-drawn", "true");
    new uPlot(opts, data, el);
  }
  function draw() {
    if (typeof uPlot === "undefined") return;
    Array.prototype.forEach.call(document.querySelectorAll(".chart[data-series]"), drawOne);
  }
  if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", draw); else draw();
})();
