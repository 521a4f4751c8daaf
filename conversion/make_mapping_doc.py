"""Regenerate the tables in conversion/MAPPING.md from performer_hf.conversion.mapping.

python conversion/make_mapping_doc.py
"""

from pathlib import Path

from performer_hf.conversion.mapping import rules_markdown

BEGIN, END = "<!-- tables: begin -->\n", "<!-- tables: end -->\n"

if __name__ == "__main__":
    doc = Path(__file__).with_name("MAPPING.md")
    text = doc.read_text()
    head, _, rest = text.partition(BEGIN)
    _, _, tail = rest.partition(END)
    doc.write_text(head + BEGIN + rules_markdown() + "\n" + END + tail)
    print(f"wrote {doc}")
