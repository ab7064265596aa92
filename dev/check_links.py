#!/usr/bin/env python3
"""Check the relative links of walcast's Markdown: README.md, docs/*.md and
examples/**/README.md. Every relative target must exist, and every `#anchor` (in the same
file or in another .md) must be the GitHub slug of one of that file's headings. Prints
each broken link as file:line and exits 1 if there is any."""
import os
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FENCE = re.compile(r'^\s*(```|~~~)')
HEADING = re.compile(r'^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$')
# [text](target) and ![alt](target), the text possibly spanning lines; no nested ().
LINK = re.compile(r'!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+"[^"]*")?\s*\)')


def files():
    out = [ROOT / 'README.md'] + sorted((ROOT / 'docs').glob('*.md'))
    out += sorted((ROOT / 'examples').glob('**/README.md'))
    return [f for f in out if f.is_file() and 'node_modules' not in f.parts]


def prose(text):
    """The file's lines with fenced code blocks and inline code blanked (same line count)."""
    lines, fenced = [], False
    for line in text.split('\n'):
        if FENCE.match(line):
            fenced = not fenced
            lines.append('')
        else:
            lines.append('' if fenced else re.sub(r'`[^`]*`', lambda m: ' ' * len(m.group()), line))
    return lines


def slug(heading):
    s = re.sub(r'\[([^\]]*)\]\([^)]*\)', r'\1', heading)  # a link in a heading: its text
    s = s.strip().lower().replace('`', '')
    s = re.sub(r'[^\w\- ]', '', s)  # punctuation goes, but - and _
    return s.replace(' ', '-')


_anchors = {}


def anchors(path):
    if path not in _anchors:
        seen, found, fenced = {}, set(), False
        for line in path.read_text(encoding='utf-8').split('\n'):
            if FENCE.match(line):
                fenced = not fenced
                continue
            m = None if fenced else HEADING.match(line)
            if m:
                base = slug(m.group(2))
                n = seen.get(base, 0)
                seen[base] = n + 1
                found.add(base if n == 0 else f'{base}-{n}')
        _anchors[path] = found
    return _anchors[path]


def check(path):
    broken = []
    lines = prose(path.read_text(encoding='utf-8'))
    text = '\n'.join(lines)
    for m in LINK.finditer(text):
        target = m.group(1)
        if re.match(r'^[a-z][a-z0-9+.-]*:', target, re.I):  # http:, mailto: …
            continue
        line = text.count('\n', 0, m.start()) + 1
        where, _, anchor = target.partition('#')
        dest = path if not where else (path.parent / where).resolve()
        if where and not os.path.exists(dest):
            broken.append((line, target, 'no such file'))
        elif anchor and dest.suffix == '.md' and dest.is_file() and anchor not in anchors(dest):
            broken.append((line, target, 'no such heading'))
    return broken


def main():
    bad = 0
    for path in files():
        for line, target, why in check(path):
            print(f'{path.relative_to(ROOT)}:{line}: {target} ({why})')
            bad += 1
    if bad:
        print(f'{bad} broken link(s)')
    return 1 if bad else 0


if __name__ == '__main__':
    sys.exit(main())
