package enforce

import (
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
)

// A hook binary that runc is executing cannot be opened for writing
// (ETXTBSY); Install must replace it all the same, and leave the running
// process its old file.
func TestInstallReplacesAFileInUse(t *testing.T) {
	dir := t.TempDir()
	sleep, err := exec.LookPath("sleep")
	if err != nil {
		t.Fatal(err)
	}
	if err := Install(sleep, dir, "hook", 0o755); err != nil {
		t.Fatal(err)
	}
	running := exec.Command(filepath.Join(dir, "hook"), "30")
	if err := running.Start(); err != nil {
		t.Fatal(err)
	}
	defer func() { _ = running.Process.Kill(); _ = running.Wait() }()
	// Writing over it in place is what fails.
	if _, err := os.OpenFile(filepath.Join(dir, "hook"), os.O_WRONLY|os.O_TRUNC, 0); err == nil || !strings.Contains(err.Error(), "text file busy") {
		t.Fatalf("opening a running binary for writing: %v, want text file busy (the case Install exists for)", err)
	}
	src := filepath.Join(t.TempDir(), "new")
	if err := os.WriteFile(src, []byte("#!/bin/sh\necho new\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := Install(src, dir, "hook", 0o755); err != nil {
		t.Fatalf("Install over a running binary: %v", err)
	}
	out, err := exec.Command(filepath.Join(dir, "hook")).Output()
	if err != nil || string(out) != "new\n" {
		t.Fatalf("the installed hook ran: %q, %v; want the new file", out, err)
	}
	fi, err := os.Stat(filepath.Join(dir, "hook"))
	if err != nil || fi.Mode().Perm() != 0o755 {
		t.Fatalf("mode %v, %v; want 0755", fi.Mode(), err)
	}
	left, _ := filepath.Glob(filepath.Join(dir, ".hook.new-*"))
	if len(left) != 0 {
		t.Fatalf("temporary files left: %v", left)
	}
}

func TestInstallSaysWhatFailed(t *testing.T) {
	err := Install(filepath.Join(t.TempDir(), "missing"), t.TempDir(), "libnvidia-ml.so.1", 0o644)
	if err == nil || !strings.Contains(err.Error(), "install libnvidia-ml.so.1") {
		t.Fatalf("err = %v, want one naming the file", err)
	}
	src := filepath.Join(t.TempDir(), "lib")
	if err := os.WriteFile(src, []byte("x"), 0o600); err != nil {
		t.Fatal(err)
	}
	err = Install(src, filepath.Join(t.TempDir(), "no-such-dir"), "lib", 0o644)
	if err == nil || !strings.Contains(err.Error(), "no-such-dir") {
		t.Fatalf("err = %v, want one naming the directory", err)
	}
}
