"""The Textual TUI (`workbench tui`): WorkbenchApp, its panels and controllers. See docs/tui.md."""
