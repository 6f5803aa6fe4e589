"""What crosses between Tandem's processes: every message one process sends another, as
frozen, typed, torch-free dataclasses and enums, and the one framing of the byte streams that
carry them. The lowest layer: it imports no other part of Tandem but ``kvtransfer``'s types."""
