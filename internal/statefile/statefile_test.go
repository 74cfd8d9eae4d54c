package statefile

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// A write replaces the file whole and leaves no temporary file behind; a
// corrupt file is named when read; a missing one is os.ErrNotExist.
func TestWriteAndRead(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "sub", "state.json")
	for _, v := range []map[string]int{{"a": 1}, {"b": 2}} {
		if err := WriteJSON(path, v); err != nil {
			t.Fatal(err)
		}
		var got map[string]int
		if err := ReadJSON(path, &got); err != nil || len(got) != 1 {
			t.Fatalf("read back %v: %v", got, err)
		}
	}
	entries, _ := os.ReadDir(filepath.Dir(path))
	if len(entries) != 1 {
		t.Errorf("files left beside the state: %v", entries)
	}
	if info, err := os.Stat(path); err != nil || info.Mode().Perm() != 0o600 {
		t.Errorf("mode %v, %v; want 0600", info.Mode(), err)
	}
	if err := os.WriteFile(path, []byte("{"), 0o600); err != nil {
		t.Fatal(err)
	}
	var v map[string]int
	if err := ReadJSON(path, &v); err == nil || !strings.Contains(err.Error(), path+" is corrupt") {
		t.Errorf("corrupt file: %v", err)
	}
	if err := ReadJSON(filepath.Join(dir, "none"), &v); !os.IsNotExist(err) {
		t.Errorf("missing file: %v", err)
	}
	// A directory that cannot be made is an error naming the path.
	if err := Write(filepath.Join(path, "x"), nil); err == nil {
		t.Error("wrote under a file")
	}
}
