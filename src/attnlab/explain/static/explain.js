// The attnlab explainer page: displays what attnlab's Python models computed.
//
// Every number shown comes from the JSON that `attnlab explain` embeds in the page
// (#attnlab-data).  The one formula computed here is Amdahl's law, because its three
// sliders span ~10^6 combinations; tests/test_explain_browser.py checks this copy against
// attnlab.model.amdahl at every slider stop.  Vanilla JS, no network, no frameworks.
"use strict";

(function () {
  const DATA = JSON.parse(document.getElementById("attnlab-data").textContent);
  const SVG_NS = "http://www.w3.org/2000/svg";

  const byId = (id) => document.getElementById(id);
  const setText = (id, text) => { byId(id).textContent = text; };

  function svgElement(tag, attributes, parent) {
    const element = document.createElementNS(SVG_NS, tag);
    for (const [name, value] of Object.entries(attributes || {})) {
      element.setAttribute(name, String(value));
    }
    if (parent) parent.appendChild(element);
    return element;
  }

  // ---------------------------------------------------------------- Amdahl's law
  // Same expression, same operation order as attnlab.model.amdahl.amdahl_speedup.
  function amdahlSpeedup(timeShare, kernelSpeedup) {
    return 1.0 / ((1.0 - timeShare) + timeShare / kernelSpeedup);
  }

  // The layer is `layerShare` of end-to-end time and nothing outside it changes, so the
  // kernel's share of end-to-end time is layerShare * timeShare (a serial critical path).
  function endToEndSpeedup(layerShare, timeShare, kernelSpeedup) {
    return amdahlSpeedup(layerShare * timeShare, kernelSpeedup);
  }

  function latencyReductionPercent(speedup) {
    return (1.0 - 1.0 / speedup) * 100.0;
  }

  const formatSpeedup = (value) => value.toFixed(3) + "\u00d7";
  const formatPercent = (value) => value.toFixed(2) + "%";

  // ---------------------------------------------------------------- stepper
  // Forward / back / play / reset for a walk with `count()` states (state 0 = start).
  // Keyboard: Left/Right step, Home resets, End jumps to the last state, P plays/pauses.
  function makeStepper(root, count, render, intervalMs) {
    let index = 0;
    let timer = null;
    const playButton = root.querySelector('[data-action="play"]');
    const backButton = root.querySelector('[data-action="back"]');
    const forwardButton = root.querySelector('[data-action="forward"]');

    function show(next) {
      index = Math.max(0, Math.min(count() - 1, next));
      root.dataset.step = String(index);
      backButton.disabled = index === 0;
      forwardButton.disabled = index === count() - 1;
      render(index);
    }
    function stop() {
      if (timer !== null) clearInterval(timer);
      timer = null;
      playButton.textContent = "Play";
      playButton.setAttribute("aria-pressed", "false");
    }
    function togglePlay() {
      if (timer !== null) { stop(); return; }
      if (index >= count() - 1) show(0);
      playButton.textContent = "Pause";
      playButton.setAttribute("aria-pressed", "true");
      timer = setInterval(() => {
        show(index + 1);
        if (index >= count() - 1) stop();  // stop on the last state, not one tick later
      }, intervalMs);
    }
    function act(action) {
      if (action === "play") { togglePlay(); return; }
      stop();
      if (action === "forward") show(index + 1);
      else if (action === "back") show(index - 1);
      else if (action === "reset") show(0);
      else if (action === "end") show(count() - 1);
    }
    root.addEventListener("click", (event) => {
      const button = event.target.closest("[data-action]");
      if (button && root.contains(button)) act(button.dataset.action);
    });
    root.addEventListener("keydown", (event) => {
      if (event.target.closest("select, input")) return;
      const keys = { ArrowRight: "forward", ArrowLeft: "back", Home: "reset", End: "end",
                     p: "play", P: "play" };
      const action = keys[event.key];
      if (!action) return;
      event.preventDefault();
      act(action);
    });
    return { show, stop, reset: () => { stop(); show(0); }, get index() { return index; } };
  }

  // ---------------------------------------------------------------- 1. memory slider
  function setUpMemory() {
    const memory = DATA.memory;
    const presetSelect = byId("memory-preset");
    const slider = byId("memory-seqlen");
    slider.max = String(memory.stops.length - 1);

    function render() {
      const preset = memory.presets.find((p) => p.name === presetSelect.value);
      const stopIndex = Number(slider.value);
      const stop = memory.stops[stopIndex];
      const values = preset.values[stopIndex];
      slider.setAttribute("aria-valuetext", stop.label + " tokens");
      setText("memory-seqlen-label", stop.label);
      setText("memory-preset-description", preset.description);
      setText("memory-scope", preset.scope);
      setText("memory-s-text", values.s_text);
      setText("memory-s-exact", values.s_exact);
      setText("memory-sp-text", values.sp_text);
      setText("memory-layers-text", values.layers_text);
      setText("memory-layers-scope", preset.layers_scope);
      setText("memory-tile-text", preset.tile.text);
      setText("memory-tile-exact", preset.tile.exact);
      setText("memory-tile-scope", preset.tile.scope);
      setText("memory-ratio-text", values.tile_ratio_text);
      drawMatrix(stop.seqlen, preset.tile);
    }

    // The score matrix of one head drawn to scale, with one score tile in its corner.
    function drawMatrix(seqlen, tile) {
      const box = byId("memory-matrix");
      box.replaceChildren();
      const side = 220;
      const root = svgElement("svg", { viewBox: `0 0 ${side + 2} ${side + 2}`, width: side + 2,
                                       height: side + 2, role: "img",
                                       "aria-label": `score matrix ${seqlen} by ${seqlen} with one ${tile.block_m} by ${tile.block_n} tile` }, box);
      svgElement("rect", { x: 1, y: 1, width: side, height: side, class: "matrix-hbm" }, root);
      const tileHeight = Math.max(1.5, side * tile.block_m / seqlen);
      const tileWidth = Math.max(1.5, side * tile.block_n / seqlen);
      svgElement("rect", { x: 1, y: 1, width: Math.min(side, tileWidth),
                           height: Math.min(side, tileHeight), class: "matrix-tile" }, root);
    }

    presetSelect.addEventListener("change", render);
    slider.addEventListener("input", render);
    render();
  }

  // ---------------------------------------------------------------- 2a. online softmax walk
  function setUpOnlineWalk() {
    const walk = DATA.online_walk;
    const keysBox = byId("walk-keys");
    const cards = walk.scores.map((score, k) => {
      const card = document.createElement("li");
      card.className = "key-card";
      card.dataset.key = String(k + 1);
      const title = document.createElement("span");
      title.className = "key-name";
      title.textContent = walk.key_labels[k];
      const scoreLine = document.createElement("span");
      scoreLine.textContent = "x = " + walk.score_texts[k];
      const valueLine = document.createElement("span");
      valueLine.textContent = "v = " + walk.value_texts[k];
      card.append(title, scoreLine, valueLine);
      keysBox.appendChild(card);
      return card;
    });

    function render(index) {
      const step = walk.steps[index];
      cards.forEach((card, k) => {
        const state = k < index - 1 ? "folded" : (k === index - 1 ? "live" : "waiting");
        card.dataset.state = state;
        card.setAttribute("aria-label", `${walk.key_labels[k]}: ${state}`);
      });
      setText("walk-step-label", step.label);
      setText("walk-m", step.m_text);
      setText("walk-alpha", step.alpha_text);
      setText("walk-l", step.l_text);
      setText("walk-a", step.a_text);
      setText("walk-o", step.o_text);
      setText("walk-narration", step.narration);
      byId("walk-state").dataset.rescaled = step.rescaled ? "true" : "false";
      const done = index === walk.steps.length - 1;
      byId("walk-result").hidden = !done;
    }

    return makeStepper(byId("walk"), () => walk.steps.length, render, 1100);
  }

  // ---------------------------------------------------------------- 2b. causal block walk
  function setUpBlockWalk() {
    const blocks = DATA.block_walk;
    const blockM = byId("block-m");
    const blockN = byId("block-n");
    const seqlen = byId("block-seqlen");
    const gridBox = byId("block-grid");
    let plan = null;
    let rowsDrawn = [];

    const planKey = () => `${blockM.value},${blockN.value},${seqlen.value}`;

    function drawGrid() {
      plan = blocks.plans[planKey()];
      gridBox.replaceChildren();
      const cell = Math.max(3, Math.min(16, Math.floor(640 / plan.kv_tiles)));
      const cellHeight = Math.max(3, Math.min(16, Math.floor(320 / plan.query_tiles)));
      const left = 34;
      const top = 18;
      const width = left + plan.kv_tiles * cell + 4;
      const height = top + plan.query_tiles * cellHeight + 4;
      const root = svgElement("svg", { viewBox: `0 0 ${width} ${height}`, width, height,
                                       role: "img", class: "block-grid-svg",
                                       "aria-label": plan.caption }, gridBox);
      svgElement("text", { x: left, y: 11, class: "axis-label" }, root).textContent =
        "KV tile j \u2192";
      rowsDrawn = plan.rows.map((row, i) => {
        const group = svgElement("g", { class: "grid-row", "data-q": i + 1 }, root);
        if (plan.query_tiles <= 64 && (i === 0 || (i + 1) % Math.ceil(plan.query_tiles / 8) === 0)) {
          svgElement("text", { x: left - 4, y: top + i * cellHeight + cellHeight - 1,
                               class: "axis-label", "text-anchor": "end" }, group).textContent =
            String(i + 1);
        }
        for (let j = 0; j < plan.kv_tiles; j += 1) {
          const state = blocks.state_names[row.states[j]];
          const rect = svgElement("rect", {
            x: left + j * cell, y: top + i * cellHeight, width: cell - 0.5, height: cellHeight - 0.5,
            class: "tile tile-" + state, "data-q": i + 1, "data-k": j + 1, "data-state": state,
          }, group);
          svgElement("title", {}, rect).textContent =
            `query tile ${i + 1}, KV tile ${j + 1}: ${state}`;
        }
        return group;
      });
      setText("block-caption", plan.caption);
    }

    function render(index) {
      const row = plan.rows[index];
      rowsDrawn.forEach((group, i) => group.classList.toggle("current", i === index));
      gridBox.dataset.queryTile = String(index + 1);
      setText("block-step-label", `query tile ${index + 1} of ${plan.query_tiles}`);
      setText("block-row-summary", row.summary);
      setText("block-row-counts", row.counts);
    }

    const stepper = makeStepper(byId("block-walk"), () => plan.query_tiles, render, 500);

    function rebuild(queryTile) {
      drawGrid();
      stepper.stop();
      stepper.show(queryTile);
    }
    for (const select of [blockM, blockN, seqlen]) {
      select.addEventListener("change", () => rebuild(0));
    }
    byId("exercise-4").addEventListener("click", () => {
      const exercise = blocks.exercise;
      blockM.value = String(exercise.block_m);
      blockN.value = String(exercise.block_n);
      seqlen.value = String(exercise.seqlen);
      rebuild(exercise.query_tile_index);
      setText("exercise-answer", exercise.answer);
      byId("exercise-answer").hidden = false;
    });
    rebuild(0);
    return stepper;
  }

  // ---------------------------------------------------------------- 4. measured charts
  // Colours, labels, headlines and every value come from the data; this code only draws.

  // 1-2-5 ticks from the largest one at or below `low` to the smallest at or above `high`,
  // so the axis always starts and ends on a labelled value.
  function niceLogTicks(low, high) {
    const all = [];
    for (let exponent = Math.floor(Math.log10(low)) - 1; exponent <= Math.ceil(Math.log10(high));
         exponent += 1) {
      for (const mantissa of [1, 2, 5]) all.push(mantissa * Math.pow(10, exponent));
    }
    const first = all.filter((v) => v <= low).pop();
    const last = all.find((v) => v >= high);
    return all.filter((v) => v >= first && v <= last);
  }

  // Linear ticks at 1, 2 or 5 times a power of ten, about five of them.
  function niceLinearTicks(high) {
    const raw = high / 5;
    const power = Math.pow(10, Math.floor(Math.log10(raw)));
    const step = [1, 2, 5, 10].map((m) => m * power).find((s) => s >= raw);
    const ticks = [];
    for (let v = 0; v <= high + step * 1e-9; v += step) ticks.push(Number(v.toPrecision(12)));
    if (ticks[ticks.length - 1] < high) ticks.push(Number((ticks.length * step).toPrecision(12)));
    return ticks;
  }

  function formatTick(value) {
    if (value >= 1) return String(Math.round(value));
    return String(Number(value.toPrecision(1)));
  }

  function attachTooltip(target, text, box, tooltip) {
    const show = () => {
      tooltip.textContent = text;
      tooltip.hidden = false;
      const boxRect = box.getBoundingClientRect();
      const rect = target.getBoundingClientRect();
      const x = rect.left - boxRect.left + rect.width / 2;
      // Keep the box inside the chart: to the left of points near the right edge.
      const left = x + 12 + tooltip.offsetWidth > boxRect.width
        ? Math.max(0, x - 12 - tooltip.offsetWidth) : x + 12;
      tooltip.style.left = `${left}px`;
      tooltip.style.top = `${rect.top - boxRect.top - 34}px`;
    };
    const hide = () => { tooltip.hidden = true; };
    target.addEventListener("mouseenter", show);
    target.addEventListener("focus", show);
    target.addEventListener("mouseleave", hide);
    target.addEventListener("blur", hide);
  }

  // The legend sits in the right margin, never over the data.
  function drawLegend(root, entries, x, y) {
    entries.forEach((entry, k) => {
      const rowY = y + k * 20;
      const group = svgElement("g", { class: "legend-entry", "data-provider": entry.provider || "" },
                               root);
      svgElement("rect", { x, y: rowY - 9, width: 12, height: 12, fill: entry.colour }, group);
      svgElement("text", { x: x + 18, y: rowY + 1,
                           class: entry.ours ? "legend-label legend-ours" : "legend-label" },
                 group).textContent = entry.label;
    });
  }

  // Latency (log-log, p20-p80 bands) or throughput (linear, with the measured ceiling).
  function drawLineChart(box, chart, mode, visible, tooltip) {
    box.replaceChildren();
    const width = 900;
    const height = 380;
    const margin = { left: 70, right: 190, top: 18, bottom: 46 };
    const series = chart.series.filter((s) => visible.has(s.provider));
    const field = chart.throughput.field;
    const value = (p) => (mode === "latency" ? p.y_ms : p[field]);
    const points = series.flatMap((s) => s.points.filter((p) => value(p) !== null));
    const plotWidth = width - margin.left - margin.right;
    const plotHeight = height - margin.top - margin.bottom;
    const root = svgElement("svg", { viewBox: `0 0 ${width} ${height}`, class: "chart-svg",
                                     role: "group", "aria-label": chart.title,
                                     "data-mode": mode }, box);
    const xs = chart.x_ticks.map((t) => t.x);
    const xLow = Math.min(...xs) / 1.3;
    const xHigh = Math.max(...xs) * 1.3;
    const xScale = (x) => margin.left + plotWidth * Math.log(x / xLow) / Math.log(xHigh / xLow);
    let yScale;
    let yTicks;
    const roof = chart.throughput.roof;
    if (mode === "latency") {
      const lows = points.map((p) => (p.p20_ms === null ? p.y_ms : p.p20_ms));
      const highs = points.map((p) => (p.p80_ms === null ? p.y_ms : p.p80_ms));
      yTicks = points.length ? niceLogTicks(Math.min(...lows) / 1.15, Math.max(...highs) * 1.15)
        : [0.01, 1];
      const yLow = yTicks[0];
      const yHigh = yTicks[yTicks.length - 1];
      yScale = (y) => margin.top + plotHeight * (1 - Math.log(y / yLow) / Math.log(yHigh / yLow));
    } else {
      const top = Math.max(roof ? roof.value : 0, ...points.map(value), 1e-9) * 1.08;
      yTicks = niceLinearTicks(top);
      const yHigh = yTicks[yTicks.length - 1];
      yScale = (y) => margin.top + plotHeight * (1 - y / yHigh);
    }
    for (const tick of yTicks) {
      const y = yScale(tick);
      svgElement("line", { x1: margin.left, x2: margin.left + plotWidth, y1: y, y2: y,
                           class: "gridline" }, root);
      svgElement("text", { x: margin.left - 6, y: y + 4, "text-anchor": "end",
                           class: "axis-label" }, root).textContent = formatTick(tick);
    }
    for (const tick of chart.x_ticks) {
      const x = xScale(tick.x);
      svgElement("line", { x1: x, x2: x, y1: margin.top, y2: margin.top + plotHeight,
                           class: "gridline" }, root);
      svgElement("text", { x, y: margin.top + plotHeight + 16, "text-anchor": "middle",
                           class: "axis-label x-tick" }, root).textContent = tick.label;
    }
    svgElement("text", { x: margin.left + plotWidth / 2, y: height - 6, "text-anchor": "middle",
                         class: "axis-title" }, root).textContent = chart.x_title;
    const yTitle = mode === "latency" ? chart.y_title : chart.throughput.y_title;
    svgElement("text", { x: 14, y: margin.top + plotHeight / 2, "text-anchor": "middle",
                         class: "axis-title",
                         transform: `rotate(-90 14 ${margin.top + plotHeight / 2})` }, root)
      .textContent = yTitle;
    if (mode === "throughput" && roof) {
      const y = yScale(roof.value);
      svgElement("line", { x1: margin.left, x2: margin.left + plotWidth, y1: y, y2: y,
                           class: "roof-line", "data-value": roof.value }, root);
      svgElement("text", { x: margin.left + plotWidth - 4, y: y - 5, "text-anchor": "end",
                           class: "roof-label" }, root).textContent = roof.label;
    }
    // Peers first, attnlab last so it is drawn on top.
    const ordered = [...series].sort((a, b) => Number(a.ours) - Number(b.ours));
    for (const s of ordered) {
      const shown = s.points.filter((p) => value(p) !== null);
      if (mode === "latency" && shown.length > 1 && shown.every((p) => p.p20_ms !== null)) {
        const upper = shown.map((p) => `${xScale(p.x).toFixed(1)},${yScale(p.p80_ms).toFixed(1)}`);
        const lower = shown.map((p) => `${xScale(p.x).toFixed(1)},${yScale(p.p20_ms).toFixed(1)}`)
          .reverse();
        svgElement("polygon", { points: [...upper, ...lower].join(" "), fill: s.colour,
                                class: "series-band", "data-provider": s.provider }, root);
      }
      const path = shown.map((p, k) => `${k ? "L" : "M"}${xScale(p.x).toFixed(1)},${yScale(value(p)).toFixed(1)}`).join(" ");
      svgElement("path", { d: path, stroke: s.colour, "data-provider": s.provider,
                           class: s.ours ? "series-line series-ours" : "series-line" }, root);
      for (const point of shown) {
        const text = mode === "latency" ? point.text
          : `${s.label} · ${point.x.toLocaleString("en-US")} tokens · ${value(point).toPrecision(3)} ${chart.throughput.unit}`;
        const dot = svgElement("circle", {
          cx: xScale(point.x), cy: yScale(value(point)), r: s.ours ? 6 : 4.5, fill: s.colour,
          class: s.ours ? "series-point series-ours" : "series-point", tabindex: 0,
          "aria-label": text, "data-provider": s.provider, "data-x": point.x,
          "data-value": value(point) }, root);
        svgElement("title", {}, dot).textContent = text;
        attachTooltip(dot, text, box, tooltip);
      }
    }
    drawLegend(root, series, width - margin.right + 16, margin.top + 12);
  }

  // Horizontal bars.  rows: [{label, ours, bars: [[{value, colour, text, key}]]}];
  // each bar is a stack of segments; `refs` are vertical reference lines (an SM count).
  function drawBarChart(box, spec) {
    box.replaceChildren();
    const width = 900;
    const labelWidth = spec.labelWidth || 320;
    const barHeight = spec.barHeight || 16;
    const right = 90;
    const top = spec.refs && spec.refs.length ? 20 : 8;
    const rowGap = 8;
    const rowHeights = spec.rows.map((r) => r.bars.length * (barHeight + 2) + rowGap);
    const plotHeight = rowHeights.reduce((a, b) => a + b, 0);
    const height = top + plotHeight + 40;
    const totals = spec.rows.flatMap((r) => r.bars.map((bar) => bar.reduce((a, s) => a + s.value, 0)));
    const high = Math.max(spec.max || 0, ...totals, ...(spec.refs || []).map((r) => r.value), 1e-9);
    const ticks = niceLinearTicks(spec.max && totals.every((t) => t <= spec.max) ? spec.max
      : high * 1.02);
    const xHigh = ticks[ticks.length - 1];
    const plotWidth = width - labelWidth - right;
    const xScale = (v) => labelWidth + plotWidth * v / xHigh;
    const root = svgElement("svg", { viewBox: `0 0 ${width} ${height}`, class: "chart-svg bar-svg",
                                     role: "group", "aria-label": spec.title || "" }, box);
    for (const tick of ticks) {
      const x = xScale(tick);
      svgElement("line", { x1: x, x2: x, y1: top, y2: top + plotHeight, class: "gridline" }, root);
      svgElement("text", { x, y: top + plotHeight + 14, "text-anchor": "middle",
                           class: "axis-label" }, root).textContent = formatTick(tick);
    }
    svgElement("text", { x: labelWidth + plotWidth / 2, y: height - 6, "text-anchor": "middle",
                         class: "axis-title" }, root).textContent = spec.unit;
    let y = top;
    spec.rows.forEach((row, r) => {
      const group = svgElement("g", { class: "bar-row-svg", "data-row": r,
                                      "data-provider": row.provider || "" }, root);
      const label = svgElement("text", { x: labelWidth - 8, y: y + barHeight - 3,
                                         "text-anchor": "end",
                                         class: row.ours ? "bar-label-svg legend-ours" : "bar-label-svg" },
                               group);
      label.textContent = row.label;
      row.bars.forEach((bar, b) => {
        let start = 0;
        const barY = y + b * (barHeight + 2);
        for (const segment of bar) {
          const rect = svgElement("rect", {
            x: xScale(start), y: barY, width: Math.max(0, xScale(start + segment.value) - xScale(start)),
            height: barHeight, fill: segment.colour, class: row.ours ? "bar-rect bar-ours" : "bar-rect",
            "data-value": segment.value, "data-key": segment.key || "", tabindex: segment.text ? 0 : -1,
            "aria-label": segment.text || "" }, group);
          if (segment.text) svgElement("title", {}, rect).textContent = segment.text;
          start += segment.value;
        }
        if (spec.valueText) {
          svgElement("text", { x: xScale(start) + 4, y: barY + barHeight - 3, class: "bar-value-svg" },
                     group).textContent = spec.valueText(row, b, start);
        }
      });
      y += rowHeights[r];
    });
    for (const ref of spec.refs || []) {
      const x = xScale(ref.value);
      svgElement("line", { x1: x, x2: x, y1: top - 4, y2: top + plotHeight, class: "roof-line",
                           "data-value": ref.value }, root);
      svgElement("text", { x: x + 4, y: top - 8, class: "roof-label" }, root).textContent = ref.label;
    }
    return root;
  }

  // Measured against predicted DRAM bytes, log-log, with y = x and the +-15% goal band.
  function drawBytesChart(box, bytes, tooltip) {
    box.replaceChildren();
    const width = 900;
    const height = 440;
    const margin = { left: 76, right: 200, top: 16, bottom: 48 };
    const values = bytes.points.flatMap((p) => [p.measured_bytes, p.cache_model_bytes,
                                                p.logical_bytes].filter((v) => v));
    const low = Math.min(...values) / 1.5;
    const high = Math.max(...values) * 1.5;
    const ticks = [];
    for (let e = Math.floor(Math.log10(low)); e <= Math.ceil(Math.log10(high)); e += 1) {
      ticks.push(Math.pow(10, e));
    }
    const lo = ticks[0];
    const hi = ticks[ticks.length - 1];
    const plotWidth = width - margin.left - margin.right;
    const plotHeight = height - margin.top - margin.bottom;
    const xScale = (v) => margin.left + plotWidth * Math.log(v / lo) / Math.log(hi / lo);
    const yScale = (v) => margin.top + plotHeight * (1 - Math.log(v / lo) / Math.log(hi / lo));
    const root = svgElement("svg", { viewBox: `0 0 ${width} ${height}`, class: "chart-svg",
                                     role: "group", "aria-label": "predicted vs measured DRAM bytes" }, box);
    const units = ["B", "kB", "MB", "GB", "TB", "PB"];
    const byteTick = (v) => {
      const e = Math.round(Math.log10(v));
      return `${Math.pow(10, e % 3)} ${units[Math.floor(e / 3)]}`;
    };
    for (const tick of ticks) {
      svgElement("line", { x1: xScale(tick), x2: xScale(tick), y1: margin.top,
                           y2: margin.top + plotHeight, class: "gridline" }, root);
      svgElement("line", { x1: margin.left, x2: margin.left + plotWidth, y1: yScale(tick),
                           y2: yScale(tick), class: "gridline" }, root);
      svgElement("text", { x: xScale(tick), y: margin.top + plotHeight + 16, "text-anchor": "middle",
                           class: "axis-label" }, root).textContent = byteTick(tick);
      svgElement("text", { x: margin.left - 6, y: yScale(tick) + 4, "text-anchor": "end",
                           class: "axis-label" }, root).textContent = byteTick(tick);
    }
    const band = [[lo, lo * 1.15], [hi, hi * 1.15], [hi, hi * 0.85], [lo, lo * 0.85]];
    svgElement("polygon", { points: band.map(([x, y]) => `${xScale(x)},${yScale(y)}`).join(" "),
                            class: "goal-band" }, root);
    svgElement("line", { x1: xScale(lo), y1: yScale(lo), x2: xScale(hi), y2: yScale(hi),
                         class: "diagonal" }, root);
    svgElement("text", { x: margin.left + plotWidth / 2, y: height - 6, "text-anchor": "middle",
                         class: "axis-title" }, root).textContent =
      "measured DRAM bytes (Nsight Compute, whole call, log scale)";
    svgElement("text", { x: 14, y: margin.top + plotHeight / 2, "text-anchor": "middle",
                         class: "axis-title",
                         transform: `rotate(-90 14 ${margin.top + plotHeight / 2})` }, root)
      .textContent = "predicted bytes (log scale)";
    bytes.points.forEach((point, k) => {
      const common = { "data-provider": point.provider, "data-case": k, tabindex: 0,
                       "aria-label": point.text };
      if (point.logical_bytes) {
        const size = 7;
        const square = svgElement("rect", { ...common, x: xScale(point.measured_bytes) - size / 2,
          y: yScale(point.logical_bytes) - size / 2, width: size, height: size,
          stroke: point.colour, class: "bytes-logical", "data-value": point.logical_bytes }, root);
        attachTooltip(square, point.text, box, tooltip);
      }
      const dot = svgElement("circle", { ...common, cx: xScale(point.measured_bytes),
        cy: yScale(point.cache_model_bytes), r: 5, fill: point.colour, class: "bytes-cache",
        "data-value": point.cache_model_bytes }, root);
      svgElement("title", {}, dot).textContent = point.text;
      attachTooltip(dot, point.text, box, tooltip);
    });
    const seen = new Map();
    for (const point of bytes.points) {
      if (!seen.has(point.provider)) seen.set(point.provider, { provider: point.provider,
        label: point.label, colour: point.colour, ours: point.provider.startsWith("attnlab") });
    }
    const legendX = width - margin.right + 16;
    drawLegend(root, [...seen.values()], legendX, margin.top + 12);
    const keyY = margin.top + 12 + seen.size * 20 + 14;
    svgElement("circle", { cx: legendX + 6, cy: keyY - 3, r: 5, class: "bytes-key" }, root);
    svgElement("text", { x: legendX + 18, y: keyY + 1, class: "legend-label" }, root)
      .textContent = "cache-aware model";
    svgElement("rect", { x: legendX + 2, y: keyY + 13, width: 8, height: 8, class: "bytes-logical",
                         stroke: "#1d2330" }, root);
    svgElement("text", { x: legendX + 18, y: keyY + 21, class: "legend-label" }, root)
      .textContent = "logical (cold cache)";
    svgElement("text", { x: legendX, y: keyY + 42, class: "legend-label" }, root)
      .textContent = "band: within ±15%";
  }

  function setUpPhase(block, defaultVisible) {
    const phase = block.phase;
    const select = byId(`family-${phase}`);
    const box = byId(`chart-${phase}`);
    const tooltip = byId(`tooltip-${phase}`);
    const toggles = byId(`toggles-${phase}`);
    const list = toggles.querySelector(".toggle-list");
    // What the reader chose, kept across workloads; untouched providers use the default.
    const chosen = new Map();
    block.charts.forEach((chart, k) => {
      const option = document.createElement("option");
      option.value = String(k);
      option.textContent = chart.title + (chart.kind === "bars" ? ` (${chart.x_ticks[0].label} only)` : "");
      select.appendChild(option);
    });
    const chart = () => block.charts[Number(select.value)];
    const mode = () => document.querySelector(`input[name="metric-${phase}"]:checked`).value;
    const visibleSet = () => new Set(chart().series.filter((s) => (chosen.has(s.provider)
      ? chosen.get(s.provider) : s.visible)).map((s) => s.provider));

    function buildToggles() {
      list.replaceChildren();
      const visible = visibleSet();
      for (const s of chart().series) {
        const label = document.createElement("label");
        label.className = "provider-toggle";
        label.style.setProperty("--swatch", s.colour);
        const box = document.createElement("input");
        box.type = "checkbox";
        box.value = s.provider;
        box.checked = visible.has(s.provider);
        box.addEventListener("change", () => { chosen.set(s.provider, box.checked); draw(); });
        const name = document.createElement("span");
        name.textContent = s.label;
        if (s.ours) name.className = "toggle-ours";
        label.append(box, name);
        list.appendChild(label);
      }
    }

    function draw() {
      const current = chart();
      const visible = visibleSet();
      const metric = mode();
      if (current.kind === "bars") {
        const field = current.throughput.field;
        const rows = current.series.filter((s) => visible.has(s.provider)).map((s) => {
          const point = s.points[0];
          const value = metric === "latency" ? point.y_ms : point[field];
          return { label: s.label, provider: s.provider, ours: s.ours,
                   bars: [[{ value: value === null ? 0 : value, colour: s.colour,
                             text: metric === "latency" ? point.text
                               : `${s.label}: ${value === null ? "not measured" : value.toPrecision(3)} ${current.throughput.unit}` }]] };
        });
        const roof = current.throughput.roof;
        drawBarChart(box, {
          title: current.title, rows, labelWidth: 220, barHeight: 18,
          unit: metric === "latency" ? `median latency at ${current.x_ticks[0].label} (ms)`
            : `${current.throughput.unit} at ${current.x_ticks[0].label}`,
          refs: metric === "throughput" && roof ? [{ value: roof.value, label: roof.label }] : [],
          valueText: (row, b, total) => (metric === "latency" ? `${total.toPrecision(3)} ms`
            : `${total.toPrecision(3)}`),
        });
      } else {
        drawLineChart(box, current, metric, visible, tooltip);
      }
      box.dataset.kind = current.kind;
    }

    function render() {
      const current = chart();
      buildToggles();
      setText(`headline-${phase}`, current.headline);
      setText(`not-measured-${phase}`, current.not_measured);
      byId(`not-measured-${phase}`).hidden = !current.not_measured;
      setText(`note-${phase}`, current.note);
      draw();
    }
    toggles.querySelector('[data-toggle="all"]').addEventListener("click", () => {
      for (const s of chart().series) chosen.set(s.provider, true);
      render();
    });
    toggles.querySelector('[data-toggle="default"]').addEventListener("click", () => {
      chosen.clear();
      render();
    });
    select.addEventListener("change", render);
    for (const radio of document.querySelectorAll(`input[name="metric-${phase}"]`)) {
      radio.addEventListener("change", draw);
    }
    render();
    return { render, defaultVisible };
  }

  function setUpMeasured() {
    const measured = DATA.measured;
    for (const block of measured.phases) {
      if (byId(`family-${block.phase}`) && block.charts.length) {
        setUpPhase(block, measured.default_visible);
      }
    }
    if (measured.bytes.points.length && byId("bytes-chart")) {
      drawBytesChart(byId("bytes-chart"), measured.bytes, byId("bytes-tooltip"));
    }
  }

  // ---------------------------------------------------------------- 5. profiler
  function setUpProfiler() {
    const profiler = DATA.profiler;
    if (!profiler.available) return;
    const listSelect = byId("kernel-list");
    if (listSelect) {
      profiler.kernel_lists.forEach((entry, k) => {
        const option = document.createElement("option");
        option.value = String(k);
        option.textContent = entry.title;
        listSelect.appendChild(option);
      });
      listSelect.value = String(profiler.kernel_list_default);
      const renderList = () => {
        const entry = profiler.kernel_lists[Number(listSelect.value)];
        setText("kernel-list-sentence", entry.sentence);
        drawBarChart(byId("kernel-list-chart"), {
          title: entry.title, unit: "time in the call (µs)", labelWidth: 320,
          rows: entry.kernels.map((k) => ({ label: `${k.label}${k.calls > 1 ? ` ×${k.calls}` : ""}`,
            bars: [[{ value: k.total_us, colour: k.colour, text: k.text, key: k.is_gemm ? "gemm" : "other" }]] })),
          valueText: (row, b, total) => `${total.toFixed(1)} µs`,
        });
        drawBarChart(byId("launch-count-chart"), {
          title: "launches per provider", unit: "kernel launches per call", labelWidth: 320,
          rows: entry.launch_counts.map((c) => ({ label: c.label, provider: c.provider,
            ours: c.provider.startsWith("attnlab"),
            bars: [[{ value: c.launches, colour: c.colour, text: c.text }]] })),
          valueText: (row, b, total) => String(total),
        });
      };
      listSelect.addEventListener("change", renderList);
      renderList();
    }
    const workloadSelect = byId("ncu-workload");
    if (!workloadSelect) return;
    profiler.workloads.forEach((workload, k) => {
      const option = document.createElement("option");
      option.value = String(k);
      option.textContent = workload.title;
      workloadSelect.appendChild(option);
    });
    workloadSelect.value = String(profiler.workload_default);
    const percent = (v) => (v === null ? 0 : v);
    const renderWorkload = () => {
      const workload = profiler.workloads[Number(workloadSelect.value)];
      const colours = profiler.sol_colours;
      setText("sol-sentence", workload.sol_sentence);
      setText("stall-sentence", workload.stall_sentence);
      setText("occupancy-sentence", workload.occupancy_sentence);
      drawBarChart(byId("sol-chart"), {
        title: "speed of light", unit: "% of peak", max: 100, labelWidth: 360, barHeight: 12,
        rows: workload.rows.map((r) => ({ label: r.row_label, provider: r.provider, ours: r.ours,
          bars: [[{ value: percent(r.sol_compute_pct), colour: colours.compute, key: "compute",
                    text: `${r.row_label}: compute ${r.sol_compute_pct}% of peak` }],
                 [{ value: percent(r.sol_memory_pct), colour: colours.memory, key: "memory",
                    text: `${r.row_label}: memory ${r.sol_memory_pct}% of peak` }]] })),
        valueText: (row, b, total) => `${total.toFixed(1)}%`,
      });
      const legend = byId("stall-legend");
      legend.replaceChildren();
      for (const item of workload.stall_legend) {
        const swatch = document.createElement("span");
        swatch.className = "swatch";
        swatch.style.background = item.colour;
        legend.append(swatch, ` ${item.label}  `);
      }
      const stallColour = new Map(workload.stall_legend.map((i) => [i.reason, i.colour]));
      drawBarChart(byId("stall-chart"), {
        title: "warp stalls", unit: "warp cycles per issued instruction", labelWidth: 360,
        rows: workload.rows.map((r) => ({ label: r.row_label, provider: r.provider, ours: r.ours,
          bars: [r.stall_segments.map((s) => ({ value: s.value, colour: stallColour.get(s.reason),
            key: s.reason, text: `${r.row_label}: ${s.reason.replace(/_/g, " ")} ${s.value.toFixed(2)} cycles` }))] })),
        valueText: (row, b, total) => total.toFixed(2),
      });
      const sms = workload.sms;
      // Bars stop at BLOCKS_PER_SM_SHOWN; the label gives the true count (eager's elementwise
      // kernels launch thousands of blocks per SM).
      const BLOCKS_PER_SM_SHOWN = 16;
      drawBarChart(byId("blocks-chart"), {
        title: "blocks per SM", labelWidth: 360, barHeight: 14, max: BLOCKS_PER_SM_SHOWN,
        unit: `blocks launched per SM${sms ? ` (${sms} SMs)` : ""}; bars stop at ${BLOCKS_PER_SM_SHOWN}`,
        rows: workload.rows.filter((r) => r.blocks_per_sm !== null).map((r) => ({
          label: r.row_label, provider: r.provider, ours: r.ours,
          note: `${r.grid_blocks.toLocaleString("en-US")} blocks (${r.blocks_per_sm.toFixed(2)}/SM)`,
          bars: [[{ value: Math.min(r.blocks_per_sm, BLOCKS_PER_SM_SHOWN), colour: r.colour, key: "blocks",
                    text: `${r.row_label}: ${r.grid_blocks.toLocaleString("en-US")} blocks on ${r.sms} SMs (${r.blocks_per_sm.toFixed(2)} per SM)` }]] })),
        refs: [{ value: 1, label: "one block per SM" }],
        valueText: (row) => row.note,
      });
      drawBarChart(byId("occupancy-chart"), {
        title: "achieved occupancy", unit: "achieved occupancy (% of the SM's warp slots)",
        max: 100, labelWidth: 360, barHeight: 14,
        rows: workload.rows.filter((r) => r.occupancy_pct !== null).map((r) => ({
          label: r.row_label, provider: r.provider, ours: r.ours,
          bars: [[{ value: r.occupancy_pct, colour: r.colour, key: "occupancy",
                    text: `${r.row_label}: ${r.occupancy_pct.toFixed(1)}% achieved occupancy, ${r.threads_per_block} threads per block, ${r.registers_per_thread} registers per thread` }]] })),
        valueText: (row, b, total) => `${total.toFixed(1)}%`,
      });
    };
    workloadSelect.addEventListener("change", renderWorkload);
    renderWorkload();
  }

  // ---------------------------------------------------------------- 6. Amdahl
  function setUpAmdahl() {
    const amdahl = DATA.amdahl;
    const shareSlider = byId("amdahl-time-share");
    const speedupSlider = byId("amdahl-kernel-speedup");
    const layerSlider = byId("amdahl-layer-share");
    const promptSelect = byId("flop-prompt");
    shareSlider.max = String(amdahl.time_share_stops.length - 1);
    speedupSlider.max = String(amdahl.kernel_speedup_stops.length - 1);
    layerSlider.max = String(amdahl.layer_share_stops.length - 1);
    shareSlider.value = String(amdahl.defaults.time_share_index);
    speedupSlider.value = String(amdahl.defaults.kernel_speedup_index);
    layerSlider.value = String(amdahl.defaults.layer_share_index);
    amdahl.flop_share.prompts.forEach((prompt, k) => {
      const option = document.createElement("option");
      option.value = String(k);
      option.textContent = prompt.label;
      promptSelect.appendChild(option);
    });
    promptSelect.value = String(amdahl.flop_share.default_index);

    function render() {
      const share = amdahl.time_share_stops[Number(shareSlider.value)];
      const speedup = amdahl.kernel_speedup_stops[Number(speedupSlider.value)];
      const layer = amdahl.layer_share_stops[Number(layerSlider.value)];
      const prompt = amdahl.flop_share.prompts[Number(promptSelect.value)];
      setText("amdahl-time-share-label", share.label);
      setText("amdahl-kernel-speedup-label", speedup.label);
      setText("amdahl-layer-share-label", layer.label);
      shareSlider.setAttribute("aria-valuetext", share.label);
      speedupSlider.setAttribute("aria-valuetext", speedup.label);
      layerSlider.setAttribute("aria-valuetext", layer.label);

      const layerSpeedup = amdahlSpeedup(share.value, speedup.value);
      const wholeSpeedup = endToEndSpeedup(layer.value, share.value, speedup.value);
      setText("amdahl-layer-speedup", formatSpeedup(layerSpeedup));
      setText("amdahl-layer-reduction", formatPercent(latencyReductionPercent(layerSpeedup)));
      setText("amdahl-e2e-speedup", formatSpeedup(wholeSpeedup));
      setText("amdahl-e2e-reduction", formatPercent(latencyReductionPercent(wholeSpeedup)));
      setText("amdahl-kernel-echo", speedup.label);
      byId("amdahl-layer-bar").style.width = `${100 / layerSpeedup}%`;
      byId("amdahl-e2e-bar").style.width = `${100 / wholeSpeedup}%`;

      const flopSpeedup = amdahlSpeedup(prompt.share, speedup.value);
      setText("flop-share", prompt.share_text);
      setText("flop-share-speedup", formatSpeedup(flopSpeedup));
      setText("flop-time-share", share.label);
      setText("flop-time-speedup", formatSpeedup(layerSpeedup));
    }
    for (const control of [shareSlider, speedupSlider, layerSlider]) {
      control.addEventListener("input", render);
    }
    promptSelect.addEventListener("change", render);
    render();
  }

  setUpMemory();
  const onlineWalk = setUpOnlineWalk();
  onlineWalk.show(0);
  setUpBlockWalk();
  setUpMeasured();
  setUpProfiler();
  setUpAmdahl();

  // For tests and the curious: the data and the one formula computed here.
  window.attnlabExplain = { data: DATA, amdahlSpeedup, endToEndSpeedup, latencyReductionPercent };
})();
