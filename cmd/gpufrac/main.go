// Command gpufrac is the one binary of gpufrac: scheduler, webhook, node
// agent and tools are its subcommands.
package main

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/signal"
	"runtime/pprof"
	"syscall"

	"github.com/gpufrac/gpufrac/internal/cli"
)

func main() {
	// SIGINT/SIGTERM cancel the context so servers shut down cleanly.
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	stopProfile := profile(os.Getenv("GPUFRAC_CPU_PROFILE"))
	err := cli.NewRootCommand().ExecuteContext(ctx)
	stop()
	stopProfile()
	if err == nil {
		return
	}
	var exit *cli.ExitError
	if errors.As(err, &exit) {
		if exit.Err != nil {
			fmt.Fprintln(os.Stderr, "error:", exit.Err)
		}
		os.Exit(exit.Code)
	}
	fmt.Fprintln(os.Stderr, "error:", err)
	os.Exit(2)
}

// profile writes a CPU profile of the whole run to path, for performance
// work on any subcommand (the scheduler serves no pprof without its secure
// port); it returns the function that finishes it.
func profile(path string) func() {
	if path == "" {
		return func() {}
	}
	f, err := os.Create(path)
	if err == nil {
		err = pprof.StartCPUProfile(f)
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "error: GPUFRAC_CPU_PROFILE:", err)
		os.Exit(2)
	}
	return func() {
		pprof.StopCPUProfile()
		_ = f.Close()
	}
}
