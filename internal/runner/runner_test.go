package runner

import (
	"path/filepath"
	"testing"
	"time"
)

// Processes that ignore SIGTERM are all killed once the grace is over,
// not only the first (a timer gives its value once).
func TestStopKillsEveryProcessLeftAfterTheGrace(t *testing.T) {
	dir := t.TempDir()
	var procs []*Process
	for _, name := range []string{"a", "b", "c"} {
		p, err := Start(name, filepath.Join(dir, name+".log"), nil, "/bin/sh", "-c", `trap "" TERM; echo started; while :; do sleep 0.1; done`)
		if err != nil {
			t.Fatal(err)
		}
		procs = append(procs, p)
	}
	time.Sleep(200 * time.Millisecond) // the traps are set
	done := make(chan struct{})
	go func() { Stop(300*time.Millisecond, procs...); close(done) }()
	select {
	case <-done:
	case <-time.After(20 * time.Second):
		t.Fatal("Stop did not return: a process outlived the grace")
	}
	for _, p := range procs {
		if p.Exited() == nil {
			t.Errorf("%s still runs", p.Name)
		}
	}
}
