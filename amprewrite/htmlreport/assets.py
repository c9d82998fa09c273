"""The page's inline style sheet and script. The script is small and optional: without it
the page shows the default module depth, folded tables that open on a click, and no filter.
"""

from __future__ import annotations

__all__ = ["CSS", "JS"]

# Precision colours: low blue, fp32 orange, passthrough grey, fp8 purple, casts yellow; the
# code, the module bars and the range chart use the same ones.
# Narrow windows (800 px): nothing is wider than the page; a wide table scrolls in its own
# box (.scroll), the SVG scales with its viewBox, and below 720 px the first screen's two
# columns stack. A module's name wraps in its column (.mlabel), never cut: names that differ
# in the middle (layers.11 and layers.17) must stay apart.
CSS = """
:root{--low:#2f6fce;--f32:#e0851f;--pass:#c4cad2;--fp8:#8a4fd0;--cast:#f2c230;--ink:#1d232a;
--mute:#5f6b78;--line:#e3e6ea}
body{font:14px/1.45 system-ui,sans-serif;margin:0;color:var(--ink)}
header{display:flex;align-items:baseline;gap:1em;padding:10px 20px;border-bottom:1px solid
var(--line)}
header h1{font-size:18px;margin:0}header span{color:var(--mute)}
main{padding:0 20px 40px}
h2{font-size:15px;margin:14px 0 6px}h3{font-size:13px;margin:12px 0 4px}
.note,.detail{color:var(--mute);font-weight:normal;font-size:12px}
.first{display:flex;gap:28px;align-items:flex-start}
@media (max-width:720px){.first{flex-direction:column}.first>section{width:100%}}
#modules{flex:3 1 0;min-width:0}#summary{flex:2 1 0;min-width:0}
.mcontrols{display:flex;flex-wrap:wrap;gap:6px 18px;align-items:center;font-size:12px;
margin-bottom:6px}
.mcontrols input{vertical-align:middle;width:9em}
.legend span{margin-right:10px;white-space:nowrap}
.legend i{display:inline-block;width:10px;height:10px;margin-right:4px;vertical-align:-1px}
.mrow{display:grid;grid-template-columns:minmax(12ch,40ch) minmax(8em,1fr) 3ch 5em 3ch;
gap:8px;align-items:center;font:12px/20px ui-monospace,monospace;cursor:pointer}
.mrow:hover:not(.mhead){background:#f3f6fb}
.mhead{font:600 11px/18px system-ui,sans-serif;color:var(--mute);cursor:default}
.mlabel{overflow-wrap:anywhere}.mlabel .parent{color:#98a1ab}
.mnum{text-align:right}
.mbar,.mcast{display:flex;height:14px;background:#f1f3f5}
.mhead .mbar,.mhead .mcast{background:none;height:auto}
.mbar i,.mcast i{display:block;height:100%}.mcast i,.p-cast{background:var(--cast)}
.p-low{background:var(--low)}.p-fp32{background:var(--f32)}.p-passthrough{background:var(--pass)}
.p-fp8{background:var(--fp8)}
table{border-collapse:collapse;font-size:12px}th,td{padding:2px 6px;text-align:left}
table.facts{width:100%}table.facts th{color:var(--mute);font-weight:500;width:9.5em;
vertical-align:top;white-space:nowrap}
table.facts td,table.facts th{border-bottom:1px solid #f0f1f3;padding:3px 6px}
b.good{color:#137333}b.bad{color:#b3261e}
table.risk{width:100%}table.risk th{color:var(--mute);font-weight:500;border-bottom:1px solid
var(--line)}
td.num{text-align:right;white-space:nowrap}td.mod{font-family:ui-monospace,monospace;
overflow-wrap:anywhere}
tr.warn td{background:#fff4e0}tr.bad td{background:#fde8e6}
tr.what-if th{font-style:italic}p.what-if{margin:0 0 4px}
.scroll{overflow-x:auto;max-width:100%}.scroll.tall{overflow:auto;max-height:85vh}
#ranges svg{display:block;width:100%;height:auto;max-width:1300px}
svg .band-n{fill:#dcebdc}svg .band-s{fill:#eef5ee}
svg .grid{stroke:#e6e8eb;stroke-width:1}svg .edge{stroke:#5b8a5b;stroke-dasharray:4 3}
svg text{font:11px system-ui,sans-serif;fill:var(--mute)}svg text.tick{text-anchor:end}
svg text.edge{fill:#3d6b3d;stroke:none}svg .ref{stroke:#8a939e;stroke-dasharray:2 3}
svg text.ref{fill:var(--mute);stroke:none}svg text.panel{fill:var(--ink);font-weight:600}
svg text.fp8{fill:var(--fp8)}
svg .ops line.low{stroke:var(--low)}svg .ops line.f32{stroke:var(--f32)}
svg .ops line.other{stroke:#8a939e}svg .nonfinite{fill:#d93025}
svg .carried{fill:none;stroke:#8a939e;stroke-width:1}
svg .h-normal{fill:var(--low)}svg .h-subnormal{fill:#e0a030}
svg .h-flush,svg .h-overflow{fill:#d93025}
pre.code{font:12px/16px ui-monospace,monospace;white-space:pre-wrap;overflow-wrap:anywhere;
background:#fafbfc;border:1px solid var(--line);padding:6px 10px;margin:0}
pre.code .ln{display:block;padding-left:8ch;text-indent:-8ch}
.dt-low{color:#1f5fbf}.dt-f32{color:#a35200}.dt-f64{color:#7a1fa2}.dt-fp8{color:var(--fp8)}
.dt-none,.dt-other{color:#6b7580}
.cast{background:#fff1b0;box-shadow:inset 3px 0 var(--cast)}
p.legend span{margin-right:.8em;padding:0 3px}
.filters{display:flex;flex-wrap:wrap;gap:6px 18px;align-items:center;font-size:12px;
margin:14px 0 6px;padding:6px 10px;background:#f6f7f9;border:1px solid var(--line)}
.filters select{max-width:min(24em,100%)}
details.fold{border-top:1px solid var(--line)}
details.fold summary{cursor:pointer;padding:4px 0}
details.fold summary h2{display:inline;margin:0}
details.fold table{margin:4px 0 10px}
details.fold th{background:#eef0f3;cursor:pointer;position:sticky;top:0}
details.fold td{border-bottom:1px solid #f0f1f3;font-family:ui-monospace,monospace}
tr.group td{background:#f6f7f9;font-weight:600;padding-top:5px}
tr.plumbing{display:none}table.show-plumbing tr.plumbing{display:table-row}
tr.plumbing td{color:var(--mute)}
table.sorted tr.group{display:none}
tr[hidden]{display:none!important}
"""

JS = """
(function () {
  function all(sel, root) { return Array.from((root || document).querySelectorAll(sel)); }
  var depth = document.getElementById('depth');
  if (depth) depth.addEventListener('input', function () {
    all('.mchart').forEach(function (c) { c.hidden = c.dataset.depth !== depth.value; });
    document.getElementById('depth-out').textContent = depth.value;
  });
  var fm = document.getElementById('f-module'), fc = document.getElementById('f-category'),
      ft = document.getElementById('f-text'), fp = document.getElementById('f-plumbing');
  // '(top level)' is modules.TOP_LEVEL: the filter's name for ops outside any submodule
  function keep(tr) {
    var m = fm.value, mod = tr.dataset.module || '', t = ft.value.toLowerCase();
    return (!m || (m === '(top level)' ? mod === '' : mod === m || mod.indexOf(m + '.') === 0))
      && (!fc.value || tr.dataset.category === fc.value)
      && (!t || tr.textContent.toLowerCase().indexOf(t) >= 0)
      && (fp.checked || !tr.classList.contains('plumbing'));
  }
  function apply() {
    all('table.filterable').forEach(function (table) {
      var groups = {}, shown = 0;
      table.classList.toggle('show-plumbing', fp.checked);
      all('tbody tr:not(.group)', table).forEach(function (tr) {
        var ok = keep(tr);
        tr.hidden = !ok;
        if (ok) { shown += 1; groups[tr.dataset.group] = true; }
      });
      all('tr.group', table).forEach(function (g) { g.hidden = !groups[g.dataset.group]; });
      table.closest('details').querySelector('.count').textContent = '(' + shown + ' shown)';
    });
  }
  if (fm) {
    [fm, fc, ft, fp].forEach(function (e) { e.addEventListener('input', apply); });
    all('.mrow[data-module]').forEach(function (row) {
      row.addEventListener('click', function () {
        fm.value = row.dataset.module || '(top level)';
        apply();
        all('details.decisions').forEach(function (d) { d.open = true; });
        document.getElementById('tables').scrollIntoView();
      });
    });
    apply();
  }
  all('table.sortable th').forEach(function (th) {
    th.addEventListener('click', function () {
      var table = th.closest('table'), body = table.tBodies[0], up = th.dataset.dir !== 'up';
      th.dataset.dir = up ? 'up' : 'down';
      table.classList.add('sorted');
      var key = function (tr) { var t = tr.cells[th.cellIndex].textContent, n = parseFloat(t);
                                return isNaN(n) ? t : n; };
      all('tr:not(.group)', body).sort(function (a, b) {
        var x = key(a), y = key(b), c = (typeof x === typeof y) ? (x < y ? -1 : x > y ? 1 : 0)
                : (typeof x === 'number' ? -1 : 1);
        return up ? c : -c; }).forEach(function (tr) { body.appendChild(tr); });
    });
  });
})();
"""
