// Drives real Chromium (Debian's, through playwright-core: no browser download) through the
// console, as a builder and as a GPU operator, and prints what the pages showed as one JSON
// line; `reference-gateway/tests/console_browser.rs` starts the gateway, agent and llama.cpp
// node, runs this, and checks the numbers against the ledger.
//
// Environment: CONSOLE_URL, BUILDER_EMAIL, OPERATOR_EMAIL, PLATFORM_EMAIL, PASSWORD, NODE_ID,
// SCREENSHOT_DIR, CHROMIUM (default /usr/bin/chromium).
import { chromium } from "playwright-core";

const env = (k) => {
  const v = process.env[k];
  if (!v) throw new Error(`${k} is not set`);
  return v;
};
const base = env("CONSOLE_URL");
const shots = env("SCREENSHOT_DIR");
// generous: a loaded 2-core machine; only a hang should hit these
const WAIT = { timeout: 90_000 };

const browser = await chromium.launch({
  executablePath: process.env.CHROMIUM || "/usr/bin/chromium",
  args: ["--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu"],
});
const out = { page_errors: [] };
try {
  // ---- the builder ------------------------------------------------------------------------
  const b = await browser.newContext({ viewport: { width: 1360, height: 820 } });
  const page = await b.newPage();
  page.setDefaultTimeout(90_000);
  page.on("pageerror", (e) => out.page_errors.push(String(e)));
  page.on("console", (m) => { if (m.type() === "error") out.page_errors.push(m.text()); });
  await page.goto(`${base}/console/requests`);
  out.redirected_to_signin = page.url().endsWith("/console/signin");
  await page.screenshot({ path: `${shots}/signin.png` });
  await page.fill("#email", env("BUILDER_EMAIL"));
  await page.fill("#password", env("PASSWORD"));
  await Promise.all([page.waitForURL("**/console/keys", WAIT), page.click("#signin")]);

  await page.fill("#key-name", "playground <script>x</script>");
  await page.fill("#key-rpm", "30");
  await page.fill("#key-tpm", "50000");
  await Promise.all([page.waitForLoadState("load"), page.click("#create-key")]);
  const key = (await page.textContent("#new-key", WAIT)).trim();
  out.key_prefix_ok = key.startsWith("sk-spine-");
  out.key_name_escaped =
    (await page.locator(".key-name").first().textContent()) === "playground <script>x</script>";
  out.key_rpm = (await page.locator("#keys tbody tr .rpm").first().textContent()).trim();
  out.key_tpm = (await page.locator("#keys tbody tr .tpm").first().textContent()).trim();
  await page.screenshot({ path: `${shots}/keys.png`, fullPage: true });
  await page.goto(`${base}/console/keys`);
  out.key_shown_again = (await page.content()).includes(key);

  await page.goto(`${base}/console/playground`);
  await page.fill("#pg-key", key);
  await page.fill("#pg-prompt", "Name three colors.");
  await page.fill("#pg-max-tokens", "24");
  await page.click("#pg-send");
  await page.waitForSelector("#playground[data-done]", WAIT);
  out.playground_done = await page.getAttribute("#playground", "data-done");
  out.playground_error = await page.textContent("#pg-error");
  out.playground_text = await page.textContent("#pg-output");
  out.request_id = await page.getAttribute("#pg-usage", "data-request-id");
  out.stream_prompt_tokens = Number(await page.getAttribute("#pg-usage", "data-prompt-tokens"));
  out.stream_completion_tokens = Number(await page.getAttribute("#pg-usage", "data-completion-tokens"));
  await page.screenshot({ path: `${shots}/playground.png`, fullPage: true });

  // the request log: poll (settlement commits just after the stream ends)
  let row = null;
  for (let i = 0; i < 60 && !row; i++) {
    await page.goto(`${base}/console/requests?model=smollm2`);
    const r = page.locator(`tr[data-request-id="${out.request_id}"]`);
    if (await r.count()) row = r;
    else await page.waitForTimeout(500);
  }
  if (!row) throw new Error(`request ${out.request_id} never showed in the log`);
  out.log_prompt_tokens = Number(await row.locator(".billed-prompt").textContent());
  out.log_completion_tokens = Number(await row.locator(".billed-completion").textContent());
  out.log_cost = (await row.locator(".cost").textContent()).trim();
  out.log_ttft = (await row.locator(".ttft").textContent()).trim();
  await page.screenshot({ path: `${shots}/requests.png`, fullPage: true });

  await page.goto(`${base}/console/usage`);
  await page.waitForSelector("#chart[data-drawn] canvas", WAIT);
  out.chart_drawn = true;
  await page.waitForSelector("#chart-spend[data-drawn] canvas", WAIT);
  const spend = JSON.parse(await page.getAttribute("#chart-spend", "data-series"));
  out.spend_micros = Math.round(spend.series[0].values.reduce((a, v) => a + v, 0) * 1e6);
  out.usage_rows = await page.locator("#usage tbody tr").count();
  out.usage_text = await page.textContent("#usage tbody");
  await page.screenshot({ path: `${shots}/usage.png`, fullPage: true });

  await page.goto(`${base}/console/balance`);
  out.balance = (await page.textContent("#balance")).trim();
  await page.screenshot({ path: `${shots}/balance.png`, fullPage: true });
  await b.close();

  // ---- the operator -----------------------------------------------------------------------
  const o = await browser.newContext({ viewport: { width: 1360, height: 820 } });
  const op = await o.newPage();
  op.setDefaultTimeout(90_000);
  await op.goto(`${base}/console/signin`);
  await op.fill("#email", env("OPERATOR_EMAIL"));
  await op.fill("#password", env("PASSWORD"));
  await Promise.all([op.waitForURL("**/console/nodes", WAIT), op.click("#signin")]);
  const node = op.locator(`tr[data-node-id="${env("NODE_ID")}"]`);
  out.node_state = (await node.locator(".state").textContent()).trim();
  out.node_earned = (await node.locator(".earned").textContent()).trim();
  await op.screenshot({ path: `${shots}/nodes.png`, fullPage: true });

  await op.goto(`${base}/console/earnings`);
  out.earned_total = (await op.textContent("#earned-total")).trim();
  out.earned_window = (await op.textContent("#earned-window")).trim();
  await op.screenshot({ path: `${shots}/earnings.png`, fullPage: true });

  await op.goto(`${base}/console/enrollments`);
  await Promise.all([op.waitForLoadState("load"), op.click("#issue-token")]);
  out.join_command = (await op.textContent("#join-command", WAIT)).trim();
  await op.screenshot({ path: `${shots}/enrollments.png`, fullPage: true });
  // (a request, not a page: a 403 page would be a console error)
  out.operator_platform_status = (await op.request.get(`${base}/console/platform`, { maxRedirects: 0 })).status();
  await o.close();

  // ---- the platform -----------------------------------------------------------------------
  const p = await browser.newContext({ viewport: { width: 1360, height: 820 } });
  const pl = await p.newPage();
  pl.setDefaultTimeout(90_000);
  pl.on("pageerror", (e) => out.page_errors.push(String(e)));
  pl.on("console", (m) => { if (m.type() === "error") out.page_errors.push(m.text()); });
  await pl.goto(`${base}/console/signin`);
  await pl.fill("#email", env("PLATFORM_EMAIL"));
  await pl.fill("#password", env("PASSWORD"));
  await Promise.all([pl.waitForURL("**/console/platform", WAIT), pl.click("#signin")]);
  await pl.waitForSelector("#chart-money[data-drawn] canvas", WAIT);
  out.platform_revenue = (await pl.textContent("#revenue")).trim();
  out.platform_operator_credits = (await pl.textContent("#operator-credits")).trim();
  out.platform_fees = (await pl.textContent("#fees")).trim();
  out.platform_requests = (await pl.textContent("#requests")).trim();
  out.platform_held = (await pl.textContent("#held")).trim();
  await pl.screenshot({ path: `${shots}/platform.png`, fullPage: true });
  await pl.goto(`${base}/console/platform/nodes`);
  const pnode = pl.locator(`tr[data-node-id="${env("NODE_ID")}"]`);
  out.platform_node_state = (await pnode.locator(".state").textContent()).trim();
  out.platform_node_operator = (await pnode.locator(".operator").textContent()).trim();
  await pl.screenshot({ path: `${shots}/platform-nodes.png`, fullPage: true });
  await pl.goto(`${base}/console/platform/discrepancies`);
  await pl.screenshot({ path: `${shots}/platform-discrepancies.png`, fullPage: true });
  out.platform_keys_status = (await pl.request.get(`${base}/console/keys`, { maxRedirects: 0 })).status();
  await p.close();
} catch (e) {
  // what was seen so far, for the failure message
  console.log(JSON.stringify(out));
  throw e;
} finally {
  await browser.close();
}
console.log(JSON.stringify(out));
