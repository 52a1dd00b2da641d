"""Reference answers for the chapters' exercises, one module per chapter (hidden from learners; see autograder/README.md)."""
