"""Check the built site: every page, its images and internal links, and a screenshot of each.

    python tools/check_site.py site [--sphinx-warnings FILE] [--screenshots site-screenshots]

Fails (exit 1) on any Sphinx warning or error in FILE (the build's `-w` log: build_docs.sh --check
passes it), a missing image, a broken internal link (file or #anchor), a page with more than one
top-level heading (a second <h1> becomes a sibling of the lessons in the sidebar: a lesson's cell
headings are underlined with "-" or "~", never "=" as its title is), a lesson page without code or
figures, or an index that does not link every lesson (the repository's [0-9][0-9]-*.py files) and
the results page. Then opens every page in headless Chromium (Debian's `chromium` package, driven
through its DevTools protocol on a pipe: no extra Python package), waits until every <img> has
loaded, fails on an image the browser could not show (not loaded, or a natural size of 0) and saves
screenshots of the whole page: one PNG for a page up to PIECE_HEIGHT pixels tall, else the page in
pieces of PIECE_HEIGHT (name_part01.png, ...), the last piece ending at the page's bottom. A page
Chromium cannot render, or shoot to its bottom, fails the check.
"""
import argparse
import base64
import fcntl
import html.parser
import json
import os
import re
import select
import shutil
import struct
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import unquote, urlparse

ROOT = Path(__file__).resolve().parents[1]


def lesson_stems(root=ROOT):
    """The lessons a site built from `root` has a page for: its [0-9][0-9]-*.py files."""
    return sorted(path.stem for path in root.glob("[0-9][0-9]-*.py"))


SPHINX_PROBLEM = re.compile(r"\b(WARNING|ERROR|CRITICAL|SEVERE)\b")


def sphinx_problems(log):
    """One problem per Sphinx warning or error in `log` (sphinx-build's -w file; its continuation
    lines, e.g. the context of a docutils message, are joined to their message)."""
    if not Path(log).exists():
        return [f"no Sphinx warnings file {log}: cannot tell whether the build warned"]
    problems = []
    for line in Path(log).read_text(errors="replace").splitlines():
        if SPHINX_PROBLEM.search(line):
            problems.append(f"Sphinx: {line.strip()}")
        elif line.strip() and problems:
            problems[-1] += f" | {line.strip()}"
    return problems


class Page(html.parser.HTMLParser):
    def __init__(self):
        super().__init__()
        self.images, self.links, self.ids, self.code_blocks, self.figures = [], [], set(), 0, 0
        self.top_headings, self._in_h1 = [], False

    def handle_endtag(self, tag):
        if tag == "h1":
            self._in_h1 = False
            self.top_headings[-1] = " ".join(self.top_headings[-1].replace("\u00b6", "").split())

    def handle_data(self, data):
        if self._in_h1:
            self.top_headings[-1] += data

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag == "h1":
            self._in_h1 = True
            self.top_headings.append("")
        if "id" in attrs:
            self.ids.add(attrs["id"])
        if tag == "img" and attrs.get("src"):
            self.images.append(attrs["src"])
            if "sphx-glr" in attrs.get("class", "") or "_images/sphx_glr" in attrs["src"]:
                self.figures += 1
        if tag == "a" and attrs.get("href"):
            self.links.append(attrs["href"])
        if tag == "div" and "highlight" in attrs.get("class", "").split():
            self.code_blocks += 1


def parse(path):
    page = Page()
    page.feed(path.read_text(errors="replace"))
    return page


def local(target, page_path):
    parsed = urlparse(target)
    if parsed.scheme or parsed.netloc or target.startswith(("mailto:", "javascript:")):
        return None, None
    file = (page_path.parent / unquote(parsed.path)).resolve() if parsed.path else page_path
    return file, parsed.fragment or None


def check(site, lessons=None):
    pages = sorted(site.rglob("*.html"))
    parsed = {path.resolve(): parse(path) for path in pages}
    problems = []
    for path, page in parsed.items():
        if len(page.top_headings) > 1:
            problems.append(f"{path.relative_to(site.resolve())}: {len(page.top_headings)} top-level headings "
                            f"{page.top_headings}: all but the title must be sections (underlined with '-' "
                            f"or '~' in a lesson), or they become siblings of the lessons in the sidebar")
        for src in page.images:
            file, _ = local(src, path)
            if file is not None and not file.exists():
                problems.append(f"{path.relative_to(site.resolve())}: missing image {src}")
            elif file is not None and file.stat().st_size == 0:
                problems.append(f"{path.relative_to(site.resolve())}: empty image file {src}")
        for href in page.links:
            file, anchor = local(href, path)
            if file is None:
                continue
            if file.is_dir():
                file = file / "index.html"
            if not file.exists():
                problems.append(f"{path.relative_to(site.resolve())}: broken link {href}")
            elif anchor and file.suffix == ".html" and anchor not in parsed.get(file, parse(file)).ids:
                problems.append(f"{path.relative_to(site.resolve())}: link {href} to a missing anchor")
    index = site / "index.html"
    for stem in lesson_stems() if lessons is None else lessons:
        page_path = (site / "lessons" / f"{stem}.html").resolve()
        page = parsed.get(page_path)
        if page is None:
            problems.append(f"no page for lesson {stem}")
            continue
        if page.code_blocks < 3:
            problems.append(f"lesson {stem}: {page.code_blocks} code blocks rendered")
        drawn = len(list((site.parent / "docs" / "lessons" / "images").glob(f"sphx_glr_{stem}_[0-9]*.png")))
        if page.figures < min(drawn, 1):     # a lesson that draws shows what it drew (07 and 08 print tables)
            problems.append(f"lesson {stem}: drew {drawn} figure(s), rendered none")
        if not any(local(h, index.resolve())[0] == page_path for h in parsed[index.resolve()].links):
            problems.append(f"index.html does not link lesson {stem}")
    if not any(local(h, index.resolve())[0] == (site / "results.html").resolve()
               for h in parsed[index.resolve()].links):
        problems.append("index.html does not link the results page")
    return pages, problems


class Chromium:
    """Headless Chromium driven through the DevTools protocol on a pipe (--remote-debugging-pipe:
    JSON messages ending in a NUL byte, commands on the browser's fd 3, answers on its fd 4)."""

    def __init__(self, browser, width=1280, height=900):
        to_browser, self._commands = os.pipe()
        self._answers, from_browser = os.pipe()
        # the browser's ends, moved to >= 10 first, so that dup2 onto 3 and 4 cannot clobber them
        keep = [fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 10) for fd in (to_browser, from_browser)]
        os.close(to_browser)
        os.close(from_browser)

        def on_fds_3_and_4():
            os.dup2(keep[0], 3)
            os.dup2(keep[1], 4)
        self.process = subprocess.Popen(
            [browser, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--mute-audio",
             "--remote-debugging-pipe", f"--window-size={width},{height}", "about:blank"],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            preexec_fn=on_fds_3_and_4, close_fds=False)
        for fd in keep:
            os.close(fd)
        self._next_id, self._buffer, self.events, self.width = 0, b"", [], width
        target = self.call("Target.createTarget", url="about:blank")["targetId"]
        self.session = self.call("Target.attachToTarget", targetId=target, flatten=True)["sessionId"]
        self.call("Page.enable", session=True)
        self.resize(height)

    def _receive(self, timeout):
        deadline = time.monotonic() + timeout
        while b"\0" not in self._buffer:
            if time.monotonic() > deadline:
                raise TimeoutError("Chromium did not answer")
            ready, _, _ = select.select([self._answers], [], [], 1.0)
            if ready:
                chunk = os.read(self._answers, 1 << 20)
                if not chunk:
                    raise RuntimeError("Chromium closed its DevTools pipe")
                self._buffer += chunk
        message, self._buffer = self._buffer.split(b"\0", 1)
        return json.loads(message)

    def call(self, method, session=False, timeout=60, **params):
        self._next_id += 1
        message = {"id": self._next_id, "method": method, "params": params}
        if session:
            message["sessionId"] = self.session
        os.write(self._commands, json.dumps(message).encode() + b"\0")
        while True:
            answer = self._receive(timeout)
            if answer.get("id") == self._next_id:
                if "error" in answer:
                    raise RuntimeError(f"{method}: {answer['error']}")
                return answer.get("result", {})
            self.events.append(answer)

    def wait_for(self, event, timeout=60):
        deadline = time.monotonic() + timeout
        while True:
            found = next((e for e in self.events if e.get("method") == event), None)
            if found:
                self.events.remove(found)
                return found
            self.events.append(self._receive(max(deadline - time.monotonic(), 0.1)))

    def evaluate(self, expression, timeout=60):
        result = self.call("Runtime.evaluate", session=True, timeout=timeout, expression=expression,
                           awaitPromise=True, returnByValue=True)
        if "exceptionDetails" in result:
            raise RuntimeError(f"script failed: {result['exceptionDetails'].get('text')}")
        return result["result"].get("value")

    def resize(self, height):
        self.call("Emulation.setDeviceMetricsOverride", session=True, width=self.width, height=height,
                  deviceScaleFactor=1, mobile=False)

    def close(self):
        try:
            self.call("Browser.close", timeout=10)
        except (RuntimeError, TimeoutError, OSError):
            pass
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
        os.close(self._commands)
        os.close(self._answers)


# Every <img> of the page loaded eagerly (a lazy one far down would never load), then, once all have
# settled, each image's src, whether it loaded and its natural size, and the page's full height.
IMAGES_AND_HEIGHT = """
(async () => {
  const images = Array.from(document.images);
  images.forEach(image => { image.loading = "eager"; });
  await Promise.all(images.map(image => image.complete ? null :
      new Promise(done => { image.addEventListener("load", done); image.addEventListener("error", done); })));
  await document.fonts.ready;
  const root = document.documentElement;
  return {height: Math.max(root.scrollHeight, document.body.scrollHeight, root.offsetHeight),
          images: images.map(image => ({src: image.getAttribute("src"), complete: image.complete,
                                        width: image.naturalWidth, height: image.naturalHeight}))};
})()
"""

PIECE_HEIGHT = 16_000    # pixels; a taller page is shot in pieces this tall (one bitmap of a 142,000-px
                         # page would take ~730 MB; the old single shot stopped at 60,000 px)


def png_size(path):
    """(width, height) from a PNG's header."""
    with open(path, "rb") as file:
        head = file.read(24)
    return struct.unpack(">II", head[16:24]) if head[:8] == b"\x89PNG\r\n\x1a\n" else (0, 0)


def piece_tops(height, piece=PIECE_HEIGHT):
    """Where each piece of a page `height` pixels tall starts: every `piece` pixels, the last one
    moved up so that it ends at the page's bottom (it overlaps the one before)."""
    if height <= piece:
        return [0]
    tops = list(range(0, height - piece, piece))
    return tops + [height - piece]


def shoot(chromium, shot, top, height):
    """The page's rows top .. top+height-1 (the viewport is `height` tall) shot to `shot`; fails
    unless the PNG is that big."""
    data = chromium.call("Page.captureScreenshot", session=True, timeout=120, format="png",
                         captureBeyondViewport=True,
                         clip={"x": 0, "y": top, "width": chromium.width, "height": height, "scale": 1})
    shot.write_bytes(base64.b64decode(data["data"]))
    width, shot_height = png_size(shot)
    if (width, shot_height) != (chromium.width, height) or shot.stat().st_size < 5_000:
        raise RuntimeError(f"screenshot {shot.name} is {width}x{shot_height}, {shot.stat().st_size} bytes; "
                           f"expected {chromium.width}x{height}")


def screenshots(site, pages, folder):
    """Each page in headless Chromium: every <img> must load with a non-zero natural size; then the
    whole page is shot into `folder`, in one piece or (taller than PIECE_HEIGHT) in several."""
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    if browser is None:
        return ["headless Chromium not found: install Debian's chromium package (apt-get install chromium)"]
    folder.mkdir(parents=True, exist_ok=True)
    problems = []
    chromium = Chromium(browser)
    try:
        for path in pages:
            name = "_".join(path.relative_to(site).with_suffix("").parts)
            where = path.relative_to(site)
            for old in folder.glob(f"{name}.png"):
                old.unlink()
            for old in folder.glob(f"{name}_part*.png"):
                old.unlink()
            try:
                chromium.resize(900)
                chromium.call("Page.navigate", session=True, url=path.resolve().as_uri())
                chromium.wait_for("Page.loadEventFired")
                page = chromium.evaluate(IMAGES_AND_HEIGHT)
                for image in page["images"]:
                    if not image["complete"] or image["width"] == 0 or image["height"] == 0:
                        problems.append(f"{where}: image {image['src']} did not load in Chromium "
                                        f"(natural size {image['width']}x{image['height']})")
                height = page["height"]
                if height <= PIECE_HEIGHT:
                    chromium.resize(height)                      # the whole page in the viewport
                    height = chromium.evaluate(IMAGES_AND_HEIGHT)["height"]
                tops = piece_tops(height)
                view = min(height, PIECE_HEIGHT)
                chromium.resize(view)
                shots = []
                for number, top in enumerate(tops, 1):
                    shot = folder / (f"{name}.png" if len(tops) == 1 else f"{name}_part{number:02d}.png")
                    shoot(chromium, shot, top, view)
                    shots.append(shot)
                final = chromium.evaluate(IMAGES_AND_HEIGHT)["height"]
                if final != height:
                    raise RuntimeError(f"the page grew from {height} to {final} px while it was shot")
            except (RuntimeError, TimeoutError, OSError, KeyError) as error:
                problems.append(f"Chromium could not shoot {where} whole: {error}")
                continue
            pieces = "" if len(shots) == 1 else f" in {len(shots)} pieces of {view} px ({shots[0].name} ...)"
            print(f"[screenshot] {folder / (name + '.png') if len(shots) == 1 else folder}: {where}, "
                  f"{chromium.width}x{height} pixels, the whole page{pieces}; {len(page['images'])} images loaded")
    finally:
        chromium.close()
    return problems


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("site", type=Path)
    parser.add_argument("--sphinx-warnings", type=Path, default=None,
                        help="sphinx-build's -w file: each warning or error in it is a problem")
    parser.add_argument("--screenshots", type=Path, default=None)
    parser.add_argument("--no-screenshots", action="store_true", help="skip Chromium (the checks of the HTML only)")
    args = parser.parse_args(argv)
    site = args.site
    problems = sphinx_problems(args.sphinx_warnings) if args.sphinx_warnings else []
    pages, found = check(site)
    problems += found
    browser = None if args.no_screenshots else shutil.which("chromium") or shutil.which("chromium-browser")
    if browser:                 # every page: each of its images rendered, and the whole page shot
        problems += screenshots(site, pages, args.screenshots or site.parent / "site-screenshots")
    for problem in problems:
        print("PROBLEM:", problem)
    if browser:
        print(f"{len(pages)} pages checked, rendered with their images and shot: "
              f"{len(problems)} problems")
    elif args.no_screenshots:
        print(f"{len(pages)} pages checked (HTML only, no screenshots asked for): {len(problems)} problems")
    else:
        print(f"{len(pages)} pages checked (images and links), {len(problems)} problems; no screenshots: "
              f"headless Chromium is not installed (Debian: sudo apt-get install chromium)")
        problems.append("no Chromium")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
