// End-to-end test of the admin console in a real headless Chromium (Debian's `chromium`,
// driven by playwright-core). scripts/test-ui.sh starts a throwaway engramd and runs this
// with ENGRAM_URL, ENGRAM_USER, ENGRAM_PASSWORD and SCREENSHOT_DIR set.
//
// Signs in, creates a knowledge base, uploads a document and waits for it to be indexed,
// runs a retrieval test, asks a question in the chat and sees the answer stream in with a
// citation, creates and revokes an API key, switches to Chinese and checks that no page shows
// untranslated text (content marked translate="no" aside); saves a screenshot of each page. Every step prints a line; the first failure ends the run with a non-zero status.
import { chromium } from "playwright-core";
import { mkdirSync, mkdtempSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import assert from "node:assert/strict";

const URL = process.env.ENGRAM_URL ?? "http://127.0.0.1:8080";
const USER = process.env.ENGRAM_USER ?? "admin";
const PASSWORD = process.env.ENGRAM_PASSWORD;
const SHOTS = process.env.SCREENSHOT_DIR ?? "target/ui-screenshots";
const KB = "handbook";
assert.ok(PASSWORD, "set ENGRAM_PASSWORD");
mkdirSync(SHOTS, { recursive: true });

const profile = mkdtempSync(join(tmpdir(), "engram-e2e-chromium-"));
const context = await chromium.launchPersistentContext(profile, {
  executablePath: process.env.CHROMIUM ?? "/usr/bin/chromium",
  headless: true,
  args: [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
  ],
  locale: "en-US",
  viewport: { width: 1366, height: 900 },
  // The API key's copy button.
  permissions: ["clipboard-read", "clipboard-write"],
});
const page = context.pages()[0] ?? (await context.newPage());
page.setDefaultTimeout(30_000);
const started = Date.now();
const step = (what) => console.log(`e2e: ${((Date.now() - started) / 1000).toFixed(1)}s ${what}`);
const shot = async (name) => {
  await page.screenshot({ path: join(SHOTS, `${name}.png`), fullPage: true });
  step(`screenshot ${name}.png`);
};
const errors = [];
page.on("pageerror", (e) => errors.push(String(e)));
// A refused form answers 422 with the form and its message, a missing page 404 with the
// console's own page (both visited on purpose and checked there); the browser logs those
// statuses as failed resource loads, which are not script errors.
page.on("console", (m) => m.type() === "error" && !/status of (422|404)/.test(m.text()) && errors.push(m.text()));

try {
  step("sign in");
  await page.goto(`${URL}/console/`);
  assert.match(page.url(), /\/console\/signin/, "a page without a session goes to sign-in");
  await shot("01-signin");
  await page.fill('input[name="name"]', USER);
  await page.fill('input[name="password"]', PASSWORD);
  await Promise.all([page.waitForURL(`${URL}/console/`), page.click('button[type="submit"]')]);
  await page.waitForSelector("svg.chart");
  await shot("02-dashboard");

  step("create a knowledge base");
  await page.goto(`${URL}/console/kb`);
  // A name the rule refuses says the rule, not the browser's "Please match the requested
  // format.", and is not sent.
  await page.fill('#kb-create input[name="name"]', "my kb");
  await page.click('#kb-create button[type="submit"]');
  assert.match(
    await page.$eval('#kb-create input[name="name"]', (el) => el.validationMessage),
    /letters, digits/,
    "the name's rule is the message",
  );
  assert.match(page.url(), /\/console\/kb$/, "a refused name is not sent");
  await page.fill('#kb-create input[name="name"]', KB);
  await Promise.all([page.waitForURL(/\/console\/kb\/handbook/), page.click('#kb-create button[type="submit"]')]);
  assert.ok(await page.isVisible(".flash.ok"), "a notice says the knowledge base exists");

  step("upload a document and wait for it to be indexed");
  await page.setInputFiles("#upload-files", [
    {
      name: "leave-policy.md",
      mimeType: "text/markdown",
      buffer: Buffer.from(
        "# Leave policy\n\nEvery employee gets 25 days of paid leave per year. " +
          "Unused leave expires at the end of March of the following year.\n\n" +
          "# Travel\n\nBook trains for trips under 500 km; flights need a manager's approval.\n",
      ),
    },
  ]);
  await Promise.all([
    page.waitForURL(/ok=flash\.uploaded/, { timeout: 60_000 }),
    page.click('#upload-form button[type="submit"]'),
  ]);
  assert.ok(await page.isVisible(".flash.ok"), "a notice says the upload was accepted");
  assert.doesNotMatch(page.url(), /ok=/, "the notice leaves the address");
  await page.waitForSelector('tr[data-doc="leave-policy.md"][data-stage="done"]', { timeout: 180_000 });
  await shot("03-documents");

  step("uploads no parser reads are refused; a failed document keeps its row one line high");
  await page.setInputFiles("#upload-files", [
    // A GIF: no parser reads it (PNG, JPEG and TIFF scans go to OCR).
    { name: "scan.gif", mimeType: "image/gif", buffer: Buffer.from("474946383961100010008000", "hex") },
    { name: "broken.pdf", mimeType: "application/pdf", buffer: Buffer.from("%PDF-1.4 not really a PDF") },
  ]);
  await page.click('#upload-form button[type="submit"]');
  await page.waitForSelector("#upload-progress li.flash.error");
  assert.match(
    await page.innerText("#upload-progress"),
    /scan\.gif: not a format Engram reads; upload PDF, DOCX, HTML, Markdown or plain text/,
    "the refused file's reason stays on the page",
  );
  await page.waitForSelector('tr[data-doc="broken.pdf"][data-stage="failed"]', { timeout: 60_000 });
  assert.equal(await page.locator('tr[data-doc="scan.gif"]').count(), 0, "the image was not stored");
  const height = async (doc) => (await page.locator(`tr[data-doc="${doc}"]`).boundingBox()).height;
  const [failedRow, doneRow] = [await height("broken.pdf"), await height("leave-policy.md")];
  assert.ok(failedRow <= doneRow * 1.25, `the failed row is ${failedRow} px high, the done one ${doneRow} px`);
  assert.ok(
    (await page.getAttribute('tr[data-doc="broken.pdf"] .error-text', "title")).length > 0,
    "the failure's message is the label's tooltip",
  );
  assert.deepEqual(
    [await page.innerText('tr[data-doc="broken.pdf"] td.actions'), await page.innerText('tr[data-doc="leave-policy.md"] td.actions')].map((t) => t.match(/Retry|Re-index/g)),
    [["Retry"], ["Re-index"]],
    "Retry on the failed document, Re-index on the done one",
  );
  assert.match(await page.innerText("#kb-counts"), /^2 \(1 failed\)/, "the settings card counts both documents");
  await shot("03b-documents-failed");
  await page.click('tr[data-doc="leave-policy.md"] a');
  await page.waitForSelector("article.chunk");
  await shot("04-document-chunks");
  await page.goto(`${URL}/console/kb`);
  assert.match(await page.innerText(`tr:has(a[href="/console/kb/${KB}"])`), /2 \(1 failed\)/, "the list counts failed documents and says so");
  await shot("05-knowledge-bases");

  step("retrieval test");
  await page.goto(`${URL}/console/retrieval`);
  await page.fill('#retrieval-form input[name="q"]', "paid leave days");
  await Promise.all([page.waitForURL(/q=paid/), page.click('#retrieval-form button[type="submit"]')]);
  await page.waitForSelector(".hit mark");
  const hits = await page.locator(".hit").count();
  assert.ok(hits >= 1, "at least one hit");
  assert.match(await page.locator(".hit .scores").first().innerText(), /BM25/);
  await shot("06-retrieval");

  step("chat: a streamed answer with a citation");
  await page.goto(`${URL}/console/chat`);
  await page.fill('#chat-form textarea[name="question"]', "How many days of paid leave does an employee get?");
  await page.fill('#chat-form input[name="max_tokens"]', "16");
  const chatUrl = page.url();
  const streamed = page.waitForResponse((r) => r.url().endsWith("/console/chat/stream"));
  await page.click("#chat-submit");
  const res = await streamed;
  assert.match(res.headers()["content-type"] ?? "", /text\/event-stream/);
  await page.waitForSelector('#answer[data-done="1"]', { timeout: 120_000 });
  assert.equal(page.url(), chatUrl, "the answer streamed into the page (no navigation)");
  assert.ok((await page.innerText("#answer")).trim().length > 0, "an answer");
  assert.ok((await page.locator("#citations a").count()) >= 1, "a citation");
  assert.notEqual(await page.innerText('#timings tr[data-field="first_token_ms"] td'), "–");
  await shot("07-chat");
  await Promise.all([page.waitForURL(/#chunk-\d+$/), page.click("#citations a >> nth=0")]);
  await page.waitForSelector("article.chunk:target");
  await shot("08-citation");

  step("create and revoke an API key");
  await page.goto(`${URL}/console/keys`);
  // Without a scope the form comes back with its message on it and the name as typed.
  await page.fill('#key-form input[name="name"]', "e2e reader");
  await page.click('#key-form button[type="submit"]');
  assert.match(await page.innerText("#key-form .form-error"), /scope/);
  assert.equal(await page.inputValue('#key-form input[name="name"]'), "e2e reader");
  await page.check('#key-form input[name="scopes"][value="search"]');
  await page.check(`#key-form input[name="collections"][value="${KB}"]`);
  await page.click('#key-form button[type="submit"]');
  const key = (await page.innerText("#new-key-value")).trim();
  assert.match(key, /^egk_[A-Za-z0-9]{8}_[A-Za-z0-9]{32}$/);
  await page.click("#copy-key");
  await page.waitForFunction(() => document.getElementById("copy-key").textContent === "Copied");
  assert.equal(await page.evaluate(() => navigator.clipboard.readText()), key, "the copy button copies the key");
  const id = key.slice(4, 12);
  assert.match(await page.innerText(`tr[data-key="${id}"]`), /e2e reader[\s\S]*never/);
  const check = await fetch(`${URL}/api/v1/collections`, { headers: { Authorization: `Bearer ${key}` } });
  assert.equal(check.status, 200, "the new key works on the API");
  await shot("09-api-key-created");
  // The create form redirects: reloading shows the secret no more and creates no key.
  const rows = await page.locator("#keys-table tbody tr").count();
  await page.reload();
  assert.equal(await page.locator("#new-key-value").count(), 0, "the key is shown once");
  assert.doesNotMatch(await page.innerText(`tr[data-key="${id}"] td.last-used`), /never/, "its use is shown");
  assert.equal(await page.locator("#keys-table tbody tr").count(), rows, "a reload creates no key");
  // Revoking asks first: dismissed, nothing happens; accepted, the key goes.
  page.once("dialog", (d) => d.dismiss());
  await page.click(`tr[data-key="${id}"] button`);
  await page.waitForTimeout(300);
  assert.equal(await page.locator(`tr[data-key="${id}"]`).count(), 1, "a dismissed confirmation keeps the key");
  let asked = "";
  page.once("dialog", (d) => {
    asked = d.message();
    d.accept();
  });
  await Promise.all([
    page.waitForURL(/ok=flash\.key_revoked/),
    page.click(`tr[data-key="${id}"] button`),
  ]);
  assert.match(asked, /Revoke egk_/, "the confirmation names the key");
  assert.equal(await page.locator(`tr[data-key="${id}"]`).count(), 0, "the key is gone");
  await page.reload();
  assert.equal(await page.locator(".flash.ok").count(), 0, "a reload does not repeat the notice");
  const after = await fetch(`${URL}/api/v1/collections`, { headers: { Authorization: `Bearer ${key}` } });
  assert.equal(after.status, 401, "the revoked key is refused");
  await shot("10-api-key-revoked");

  step("dashboard: refused keys counted apart from the generation queue");
  await page.goto(`${URL}/console/`);
  assert.match(await page.innerText("#auth-refused"), /^[1-9]\d* refused: missing or wrong key$/);
  assert.equal(await page.innerText("#queue-rejected"), "0 turned away (queue full)");

  step("users, settings, audit");
  for (const [path, name] of [
    ["users", "11-users"],
    ["settings", "12-settings"],
    ["audit", "13-audit"],
  ]) {
    await page.goto(`${URL}/console/${path}`);
    await shot(name);
  }
  assert.ok(await page.isVisible("tr.audit-key_revoked"), "the audit log shows the revocation");

  step("a 1,000-chunk document: live progress, then its chunks a page at a time");
  await page.goto(`${URL}/console/kb`);
  await page.fill('#kb-create input[name="name"]', "manual");
  await page.fill('#kb-create input[name="chunk_tokens"]', "16");
  await page.fill('#kb-create input[name="overlap_tokens"]', "0");
  await Promise.all([page.waitForURL(/\/console\/kb\/manual/), page.click('#kb-create button[type="submit"]')]);
  const manual = Array.from(
    { length: 1000 },
    (_, i) => `Machine ${i + 1} needs a new filter every ${(i % 12) + 1} months; its log is kept in room ${i % 40}.`,
  ).join("\n\n");
  await page.setInputFiles("#upload-files", [{ name: "manual.md", mimeType: "text/markdown", buffer: Buffer.from(manual) }]);
  await Promise.all([page.waitForURL(/\/console\/kb\/manual/), page.click('#upload-form button[type="submit"]')]);
  // The list refreshes itself while the document moves through the stages: no reload here.
  const row = 'tr[data-doc="manual.md"]';
  const seen = new Set();
  let bar = false;
  for (const until = Date.now() + 240_000; ; ) {
    const stage = await page.getAttribute(row, "data-stage");
    seen.add(stage);
    if (!bar && (await page.locator(`${row} progress`).count()) > 0) {
      bar = true;
      await shot("18-ingestion-progress");
    }
    if (stage === "done") break;
    assert.notEqual(stage, "failed", await page.innerText(row));
    assert.ok(Date.now() < until, `still ${stage}`);
    await page.waitForTimeout(100);
  }
  assert.ok(seen.size > 1, `the row changed stage live (${[...seen].join(" -> ")})`);
  step(`  stages seen live: ${[...seen].join(" -> ")}${bar ? ", with a progress bar" : ""}`);
  await page.click(`${row} a`);
  await page.waitForSelector("#chunk-pager");
  const [, total] = (await page.innerText("#chunk-pager span")).match(/\/ (\d+)/);
  assert.ok(Number(total) >= 1000, `${total} chunks`);
  assert.equal(await page.locator("article.chunk").count(), 50, "50 chunks to a page");
  await Promise.all([page.waitForURL(/page=2/), page.click('#chunk-pager a[rel="next"]')]);
  assert.match(await page.innerText("#chunk-pager span"), /^51–100 \//);
  await shot("19-chunks-page-2");

  step("switch to Chinese");
  await page.goto(`${URL}/console/`);
  await Promise.all([page.waitForURL(`${URL}/console/`), page.click('a[lang="zh-CN"]')]);
  assert.equal(await page.getAttribute("html", "lang"), "zh-CN");
  assert.match(await page.innerText("nav.sidebar"), /仪表盘/);
  await shot("14-dashboard-zh");
  await page.goto(`${URL}/console/kb/${KB}`);
  assert.match(await page.innerText("main"), /已索引/);
  await shot("15-documents-zh");
  await page.goto(`${URL}/console/chat`);
  await shot("16-chat-zh");
  // No knowledge base ticked: the message is in Chinese (it was the API's English).
  for (const box of await page.locator('#chat-form input[name="collections"]').all()) await box.uncheck();
  await page.fill('#chat-form textarea[name="question"]', "年假有多少天？");
  await page.click("#chat-submit");
  await page.waitForSelector("#answer-error:not([hidden])");
  assert.match(await page.innerText("#answer-error"), /请至少勾选一个知识库/);
  await page.goto(`${URL}/console/audit`);
  await shot("17-audit-zh");

  step("every page in Chinese: no untranslated text");
  // Content (document names and text, answers, identifiers, model names) is marked
  // translate="no" in the templates; what is left must be Chinese. Two English words in a
  // row are an untranslated string (single technical terms like KV, BM25 or token pass).
  const english = async () =>
    page.evaluate(() => {
      const body = document.body.cloneNode(true);
      body.querySelectorAll('[translate="no"], script, style, code, pre, .mono, input, textarea, select').forEach((e) => e.remove());
      // Each text node on its own (a run may not cross elements); command lines quoted in the
      // help texts stay as typed.
      const runs = [];
      const walk = document.createTreeWalker(body, NodeFilter.SHOW_TEXT);
      for (let n = walk.nextNode(); n; n = walk.nextNode()) {
        const text = n.textContent.replace(/\s+/g, " ").replace(/engramd(?: [a-z-]+)+(?: [A-Z]+)?/g, "");
        runs.push(...[...text.matchAll(/[A-Za-z][A-Za-z'’]+(?:[ -][A-Za-z][A-Za-z'’]+)+/g)].map((m) => m[0]));
      }
      return runs;
    });
  const docHref = await (async () => {
    await page.goto(`${URL}/console/kb/${KB}`);
    return page.getAttribute('a[href*="/doc/"]', "href");
  })();
  const found = {};
  for (const path of [
    "/console/",
    "/console/kb",
    `/console/kb/${KB}`,
    docHref,
    "/console/kb/manual",
    `/console/kb/${KB}/delete`,
    `/console/retrieval?q=paid+leave&mode=hybrid&top_k=3&collections=${KB}`,
    "/console/chat",
    "/console/keys",
    "/console/users",
    "/console/settings",
    "/console/audit",
    "/console/no/such/page",
  ]) {
    await page.goto(`${URL}${path}`);
    const runs = await english();
    if (runs.length) found[path] = [...new Set(runs)];
  }
  assert.deepEqual(found, {}, "untranslated text on the Chinese pages");

  step("delete a knowledge base: a notice says so");
  await page.goto(`${URL}/console/kb/manual/delete`);
  await page.fill('input[name="confirm"]', "manual");
  await Promise.all([page.waitForURL(/\/console\/kb(\?|$)/), page.click('form button[type="submit"].danger')]);
  assert.match(await page.innerText(".flash.ok"), /知识库已删除/);
  assert.equal(await page.locator('a[href="/console/kb/manual"]').count(), 0, "the knowledge base is gone");

  assert.deepEqual(errors, [], "no script errors in the pages");
  step("ok");
} catch (e) {
  await page.screenshot({ path: join(SHOTS, "failure.png"), fullPage: true }).catch(() => {});
  console.error(`e2e: FAILED at ${page.url()}: ${e.stack ?? e}`);
  process.exitCode = 1;
} finally {
  await context.close();
  rmSync(profile, { recursive: true, force: true });
}
