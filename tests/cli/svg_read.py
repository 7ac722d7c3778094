#!/usr/bin/env python3
"""Reads an SVG picture written by `reshard` with a real XML parser (expat, through
xml.etree.ElementTree) and prints, as JSON, every element that has a class attribute: its tag,
its attributes and the geometry of its child <rect>s. Tests compare these with the JSON output
the picture was drawn from. Exit status 1 (with the parser's message) if the file is not
well-formed XML or its root is not an SVG element."""
import json
import sys
import xml.etree.ElementTree as ET

NS = "{http://www.w3.org/2000/svg}"


def local(tag):
    return tag[len(NS):] if tag.startswith(NS) else tag


def main():
    try:
        root = ET.parse(sys.argv[1]).getroot()
    except ET.ParseError as e:
        print(f"{sys.argv[1]}: not well-formed XML: {e}", file=sys.stderr)
        return 1
    if local(root.tag) != "svg":
        print(f"{sys.argv[1]}: root element is <{local(root.tag)}>, not <svg>", file=sys.stderr)
        return 1
    out = {"root": dict(root.attrib), "elements": []}
    for el in root.iter():
        cls = el.get("class")
        if cls is None:
            continue
        rects = [[float(r.get(k)) for k in ("x", "y", "width", "height")]
                 for r in el if local(r.tag) == "rect"]
        out["elements"].append({"tag": local(el.tag), "class": cls, "attrs": dict(el.attrib), "rects": rects})
    json.dump(out, sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
