// Command gpufrac is the one binary of gpufrac: scheduler, webhook, node
// agent and tools are its subcommands.
package main

import (
	"errors"
	"fmt"
	"os"

	"github.com/gpufrac/gpufrac/internal/cli"
)

func main() {
	err := cli.NewRootCommand().Execute()
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
