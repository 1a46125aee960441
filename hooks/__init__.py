"""megastart's built-in hook implementations, each registered through the
``megastart`` entry-point group exactly as a third party's would be."""
