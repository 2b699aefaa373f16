"""Reading a file: what every reader makes (blocks), the PDF reader and the others, OCR of scanned pages, the
structure of a paper (headings, closing sections, references, superscript citations), its metadata, its chunks and
the citations inside them.
"""
