"""Check the built site: every page, its images and internal links, and a screenshot of each.

    python tools/check_site.py site [--screenshots site-screenshots]

Fails (exit 1) on a missing image, a broken internal link (file or #anchor), a lesson page without
code or figures, or an index that does not link every lesson and the results page. Then opens
every page in headless Chromium (Debian's `chromium` package) and saves a full-page screenshot,
to be looked at; a page Chromium cannot render also fails the check.
"""
import argparse
import html.parser
import shutil
import subprocess
import sys
from pathlib import Path
from urllib.parse import unquote, urlparse

LESSONS = ["01-conv-basics", "02-im2col-explicit", "03-tma-im2col-modes",
           "04-implicit-gemm-single-buffer", "05-warp-specialized-conv"]


class Page(html.parser.HTMLParser):
    def __init__(self):
        super().__init__()
        self.images, self.links, self.ids, self.code_blocks, self.figures = [], [], set(), 0, 0

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
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


def check(site):
    pages = sorted(site.rglob("*.html"))
    parsed = {path.resolve(): parse(path) for path in pages}
    problems = []
    for path, page in parsed.items():
        for src in page.images:
            file, _ = local(src, path)
            if file is not None and not file.exists():
                problems.append(f"{path.relative_to(site.resolve())}: missing image {src}")
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
    for stem in LESSONS:
        page_path = (site / "lessons" / f"{stem}.html").resolve()
        page = parsed.get(page_path)
        if page is None:
            problems.append(f"no page for lesson {stem}")
            continue
        if page.code_blocks < 3:
            problems.append(f"lesson {stem}: {page.code_blocks} code blocks rendered")
        if page.figures < 1:
            problems.append(f"lesson {stem}: no figure rendered")
        if not any(local(h, index.resolve())[0] == page_path for h in parsed[index.resolve()].links):
            problems.append(f"index.html does not link lesson {stem}")
    if not any(local(h, index.resolve())[0] == (site / "results.html").resolve()
               for h in parsed[index.resolve()].links):
        problems.append("index.html does not link the results page")
    return pages, problems


def screenshots(site, pages, folder):
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    if browser is None:
        return ["headless Chromium not found: install Debian's chromium package (apt-get install chromium)"]
    folder.mkdir(parents=True, exist_ok=True)
    problems = []
    for path in pages:
        name = "_".join(path.relative_to(site).with_suffix(".png").parts)
        shot = folder / name
        proc = subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                               "--window-size=1280,2200", f"--screenshot={shot}", path.resolve().as_uri()],
                              capture_output=True, text=True, timeout=120)
        if proc.returncode or not shot.exists() or shot.stat().st_size < 10_000:
            problems.append(f"Chromium could not render {path.relative_to(site)}: {proc.stderr[-300:]}")
        else:
            print(f"[screenshot] {shot}")
    return problems


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("site", type=Path)
    parser.add_argument("--screenshots", type=Path, default=None)
    args = parser.parse_args()
    site = args.site
    pages, problems = check(site)
    content = [p for p in pages if p.parent.name in ("", "lessons", site.name) and not p.name.startswith(("genindex", "search", "sg_"))]
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    if browser:
        problems += screenshots(site, content, args.screenshots or site.parent / "site-screenshots")
    for problem in problems:
        print("PROBLEM:", problem)
    if browser:
        print(f"{len(pages)} pages checked, {len(content)} screenshots: {len(problems)} problems")
    else:
        print(f"{len(pages)} pages checked (images and links), {len(problems)} problems; no screenshots: "
              f"headless Chromium is not installed (Debian: sudo apt-get install chromium)")
        problems.append("no Chromium")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
