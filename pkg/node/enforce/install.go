package enforce

import (
	"fmt"
	"io"
	"os"
	"path/filepath"
)

// Install copies src to dir/name so that a process already running the old
// file keeps it and the next exec gets the new one: the node agent's init
// container puts the hook binary and the nvidia-smi view library on the
// host, where runc runs the hook and containers mount the library while an
// older agent's containers still use them. Writing over the old file in
// place would fail (ETXTBSY, for the hook a runc is executing) or, for the
// library, change pages under every process that has it mapped; a file
// written beside it and renamed over it does neither. The copy is synced
// before the rename, so a node that loses power mid-install keeps the old
// file or the new one, never half of one.
func Install(src, dir, name string, mode os.FileMode) (err error) {
	// What an install that died midway left beside the file.
	stale, _ := filepath.Glob(filepath.Join(dir, "."+name+".new-*"))
	for _, f := range stale {
		_ = os.Remove(f)
	}
	in, err := os.Open(src)
	if err != nil {
		return fmt.Errorf("install %s: %w", name, err)
	}
	defer func() { _ = in.Close() }()
	tmp, err := os.CreateTemp(dir, "."+name+".new-*")
	if err != nil {
		return fmt.Errorf("install %s into %s: %w (is the host directory mounted writable?)", name, dir, err)
	}
	defer func() {
		if err != nil {
			_ = os.Remove(tmp.Name())
		}
	}()
	if _, err = io.Copy(tmp, in); err == nil {
		err = tmp.Chmod(mode)
	}
	if err == nil {
		err = tmp.Sync()
	}
	if cerr := tmp.Close(); err == nil {
		err = cerr
	}
	if err == nil {
		err = os.Rename(tmp.Name(), filepath.Join(dir, name))
	}
	if err != nil {
		return fmt.Errorf("install %s into %s: %w", name, dir, err)
	}
	return nil
}
