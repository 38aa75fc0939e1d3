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

  // ---------------------------------------------------------------- 4. measured latency
  const PALETTE = ["#1b6ac9", "#d9480f", "#2b8a3e", "#862e9c", "#e67700", "#0b7285",
                   "#c2255c", "#5c940d"];

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

  function formatTick(value) {
    if (value >= 1) return String(Math.round(value));
    return String(Number(value.toPrecision(1)));
  }

  function drawLatencyChart(box, chart, tooltip) {
    box.replaceChildren();
    const width = 720;
    const height = 360;
    const margin = { left: 64, right: 150, top: 16, bottom: 44 };
    const xs = [];
    const ys = [];
    for (const series of chart.series) {
      for (const point of series.points) { xs.push(point.x); ys.push(point.y_ms); }
    }
    const xLow = Math.min(...xs) / 1.25;
    const xHigh = Math.max(...xs) * 1.25;
    const yTicks = niceLogTicks(Math.min(...ys) / 1.2, Math.max(...ys) * 1.2);
    const yLow = yTicks[0];
    const yHigh = yTicks[yTicks.length - 1];
    const plotWidth = width - margin.left - margin.right;
    const plotHeight = height - margin.top - margin.bottom;
    const xScale = (x) => margin.left + plotWidth * Math.log(x / xLow) / Math.log(xHigh / xLow);
    const yScale = (y) => margin.top + plotHeight * (1 - Math.log(y / yLow) / Math.log(yHigh / yLow));

    const root = svgElement("svg", { viewBox: `0 0 ${width} ${height}`, class: "latency-svg",
                                     role: "group", "aria-label": chart.title }, box);
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
                           class: "axis-label" }, root).textContent = tick.label;
    }
    svgElement("text", { x: margin.left + plotWidth / 2, y: height - 6, "text-anchor": "middle",
                         class: "axis-title" }, root).textContent = chart.x_title;
    svgElement("text", { x: 14, y: margin.top + plotHeight / 2, "text-anchor": "middle",
                         class: "axis-title",
                         transform: `rotate(-90 14 ${margin.top + plotHeight / 2})` }, root)
      .textContent = chart.y_title;

    chart.series.forEach((series, s) => {
      const color = PALETTE[s % PALETTE.length];
      const path = series.points.map((p, k) => `${k ? "L" : "M"}${xScale(p.x).toFixed(1)},${yScale(p.y_ms).toFixed(1)}`).join(" ");
      svgElement("path", { d: path, class: "series-line", stroke: color }, root);
      for (const point of series.points) {
        const dot = svgElement("circle", { cx: xScale(point.x), cy: yScale(point.y_ms), r: 5,
                                           fill: color, class: "series-point", tabindex: 0,
                                           "aria-label": point.text,
                                           "data-provider": series.provider, "data-x": point.x },
                               root);
        svgElement("title", {}, dot).textContent = point.text;
        const showTip = () => {
          tooltip.textContent = point.text;
          tooltip.hidden = false;
          const boxRect = box.getBoundingClientRect();
          const dotRect = dot.getBoundingClientRect();
          const x = dotRect.left - boxRect.left + dotRect.width / 2;
          // Keep the box inside the chart: to the left of points near the right edge.
          const left = x + 12 + tooltip.offsetWidth > boxRect.width
            ? Math.max(0, x - 12 - tooltip.offsetWidth) : x + 12;
          tooltip.style.left = `${left}px`;
          tooltip.style.top = `${dotRect.top - boxRect.top - 34}px`;
        };
        const hideTip = () => { tooltip.hidden = true; };
        dot.addEventListener("mouseenter", showTip);
        dot.addEventListener("focus", showTip);
        dot.addEventListener("mouseleave", hideTip);
        dot.addEventListener("blur", hideTip);
      }
      const legendY = margin.top + 14 + s * 20;
      svgElement("rect", { x: width - margin.right + 14, y: legendY - 9, width: 12, height: 12,
                           fill: color }, root);
      svgElement("text", { x: width - margin.right + 32, y: legendY + 1, class: "legend-label" },
                 root).textContent = series.label;
    });
  }

  function setUpMeasured() {
    const measured = DATA.measured;
    for (const phase of ["prefill", "decode"]) {
      const charts = measured.charts[phase];
      const select = byId(`latency-${phase}-family`);
      const box = byId(`latency-${phase}-chart`);
      if (!select || !box || charts.length === 0) continue;
      const tooltip = byId(`latency-${phase}-tooltip`);
      charts.forEach((chart, k) => {
        const option = document.createElement("option");
        option.value = String(k);
        option.textContent = chart.title;
        select.appendChild(option);
      });
      const render = () => {
        const chart = charts[Number(select.value)];
        drawLatencyChart(box, chart, tooltip);
        setText(`latency-${phase}-note`, chart.note);
      };
      select.addEventListener("change", render);
      render();
    }
  }

  // ---------------------------------------------------------------- 5. Amdahl
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
  setUpAmdahl();

  // For tests and the curious: the data and the one formula computed here.
  window.attnlabExplain = { data: DATA, amdahlSpeedup, endToEndSpeedup, latencyReductionPercent };
})();
