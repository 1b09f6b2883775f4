#!/usr/bin/python3
"""Checks a kvaudit report.html as a person sees it (tests/report/test_report_browser.cpp).

    check_report_html.py REPORT.html --chromium PATH --heat-cells N --timeline-cells N --png OUT.png

1. Valid HTML: html5lib (Debian's python3-html5lib) parses it in strict mode, i.e. with the
   WHATWG parsing algorithm browsers use, which knows inline SVG, and raises on any parse error;
   then `tidy -e -q` (Debian's tidy) must report neither errors nor warnings (exit 0) where it is
   installed: it also lints what parses but is wrong (unknown attributes, obsolete elements).
2. Self-contained: no <script>, <link>, @import or external url(); no http(s) URL but the SVG
   namespace name.
3. The charts drew: Chromium (headless) loads the page and dumps the DOM it built; it must hold
   the expected heatmap cells (layers x steps x 4 comparisons), timeline cells, chart marks and
   limit lines.
4. Not blank: Chromium renders it to a PNG (1280 px wide); Pillow (python3-pil) decodes it and
   it must hold many distinct colours, a good share of non-white pixels, and the verdict banner's
   colour (pass green or fail red) near the top.
Exits 0 when all hold, 1 naming the first that does not.
"""
import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile


def fail(message):
    print(f"check_report_html: {message}", file=sys.stderr)
    sys.exit(1)


def check_valid(path, text):
    import html5lib  # python3-html5lib

    try:
        html5lib.HTMLParser(strict=True).parse(text)
    except Exception as error:  # html5lib raises ParseError with the position
        fail(f"{path}: not valid HTML (html5lib strict): {error}")
    tidy = shutil.which("tidy")
    if tidy:
        run = subprocess.run([tidy, "-e", "-q", path], capture_output=True, text=True)
        if run.returncode != 0:
            fail(f"{path}: tidy reports problems:\n{run.stderr}")


def check_self_contained(path, text):
    for needle in ("<script", "<link", "@import"):
        if needle in text:
            fail(f"{path}: holds {needle}: the page must need nothing outside itself")
    if re.search(r"url\((?!#)", text):
        fail(f"{path}: an url() that is not a reference inside the page")
    urls = set(re.findall(r"https?://[^\s\"'<>)]+", text)) - {"http://www.w3.org/2000/svg"}
    if urls:
        fail(f"{path}: external URLs {sorted(urls)}")


def chromium(binary, profile, *arguments):
    command = [binary, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
               "--no-first-run", f"--user-data-dir={profile}", *arguments]
    run = subprocess.run(command, capture_output=True, text=True, timeout=None)
    if run.returncode != 0:
        fail(f"chromium failed ({run.returncode}): {run.stderr[-2000:]}")
    return run.stdout


def check_dom(dom, expected):
    counts = {
        "heat-cell": len(re.findall(r'class="heat-cell[ "]', dom)),
        "timeline-cell": len(re.findall(r'class="timeline-cell"', dom)),
        "chart-mark": len(re.findall(r'class="chart-mark"', dom)),
        "limit-line": len(re.findall(r'class="limit-line"', dom)),
    }
    for name, want in expected.items():
        if name in ("chart-mark", "limit-line"):
            if counts[name] < want:
                fail(f"the DOM holds {counts[name]} {name} elements, expected at least {want}")
        elif counts[name] != want:
            fail(f"the DOM holds {counts[name]} {name} elements, expected {want}")
    if "</svg>" not in dom or "<h1>" not in dom:
        fail("the DOM lacks the charts or the verdict")
    return counts


def check_png(png):
    from PIL import Image  # python3-pil

    image = Image.open(png).convert("RGB")
    width, height = image.size
    if width < 1000 or height < 800:
        fail(f"{png}: {width}x{height}, smaller than the window asked for")
    small = image.resize((width // 4, height // 4))
    pixels = list(small.getdata())
    distinct = len(set(pixels))
    non_white = sum(1 for p in pixels if min(p) < 245) / len(pixels)
    if distinct < 64:
        fail(f"{png}: only {distinct} distinct colours: blank or unstyled")
    if non_white < 0.05:
        fail(f"{png}: {non_white:.1%} of pixels are not white: blank")
    top = image.crop((0, 0, width, 220)).getdata()
    banner = {(0xda, 0xfb, 0xe1), (0xff, 0xeb, 0xe9)}  # pass / fail background
    if not any(p in banner for p in top):
        fail(f"{png}: no verdict banner colour near the top")
    return distinct, non_white


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("html")
    parser.add_argument("--chromium", required=True)
    parser.add_argument("--heat-cells", type=int, required=True)
    parser.add_argument("--timeline-cells", type=int, required=True)
    parser.add_argument("--chart-marks", type=int, default=1)
    parser.add_argument("--limit-lines", type=int, default=1)
    parser.add_argument("--png", required=True)
    args = parser.parse_args()
    text = open(args.html, encoding="utf-8").read()
    check_valid(args.html, text)
    check_self_contained(args.html, text)
    url = "file://" + os.path.abspath(args.html)
    with tempfile.TemporaryDirectory() as profile:
        dom = chromium(args.chromium, profile, "--dump-dom", url)
        counts = check_dom(dom, {"heat-cell": args.heat_cells,
                                 "timeline-cell": args.timeline_cells,
                                 "chart-mark": args.chart_marks,
                                 "limit-line": args.limit_lines})
        chromium(args.chromium, profile, f"--screenshot={os.path.abspath(args.png)}",
                 "--window-size=1280,2000", url)
    distinct, non_white = check_png(args.png)
    print(f"check_report_html: valid, self-contained, DOM {counts}, "
          f"PNG {distinct} colours, {non_white:.0%} not white")


if __name__ == "__main__":
    main()
