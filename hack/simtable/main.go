// Command simtable turns the JSON lines of `gpufrac sim --json` runs
// (each with a "trace" field added, as hack/sim-table.sh does) into the
// Markdown table of docs/placement.md: the mean allocation at 130% arrived per trace
// and policy, the study's published FGD mean where it has one, and our
// default policy's margin over FGD (published, and as run here).
package main

import (
	"bufio"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"log"
	"math"
	"os"
	"slices"
	"strings"

	"github.com/gpufrac/gpufrac/pkg/placement"
	"github.com/gpufrac/gpufrac/pkg/sim"
)

type run struct {
	Trace      string   `json:"trace"`
	Policy     string   `json:"policy"`
	Seed       int64    `json:"seed"`
	AllocAt130 *float64 `json:"alloc_at_130"`
}

func main() {
	runs := flag.String("runs", "", "runs.jsonl")
	published := flag.String("published", "", "the study's analysis_allo_discrete.csv (optional)")
	flag.Parse()
	if err := table(os.Stdout, *runs, *published); err != nil {
		log.Fatal(err)
	}
}

func table(w io.Writer, runsPath, publishedPath string) error {
	f, err := os.Open(runsPath)
	if err != nil {
		return err
	}
	defer func() { _ = f.Close() }()
	sum := map[[2]string]float64{}
	n := map[[2]string]int{}
	seeds := map[int64]bool{}
	var traces []string
	sc := bufio.NewScanner(f)
	for line := 1; sc.Scan(); line++ {
		var r run
		if err := json.Unmarshal(sc.Bytes(), &r); err != nil {
			return fmt.Errorf("%s:%d: %w", runsPath, line, err)
		}
		if r.AllocAt130 == nil {
			continue
		}
		if !slices.Contains(traces, r.Trace) {
			traces = append(traces, r.Trace)
		}
		sum[[2]string{r.Trace, r.Policy}] += *r.AllocAt130
		n[[2]string{r.Trace, r.Policy}]++
		seeds[r.Seed] = true
	}
	if err := sc.Err(); err != nil {
		return err
	}
	mean := func(trace, policy string) float64 {
		k := [2]string{trace, policy}
		if n[k] == 0 {
			return math.NaN()
		}
		return sum[k] / float64(n[k])
	}
	publishedFGD := func(string) float64 { return math.NaN() }
	if publishedPath != "" {
		byTrace := map[string]float64{}
		for _, t := range traces {
			pf, err := os.Open(publishedPath)
			if err != nil {
				return err
			}
			p, err := sim.LoadPublished(pf, t)
			_ = pf.Close()
			if err != nil {
				return err
			}
			byTrace[t] = math.NaN()
			if fgd := p["06-FGD"]; fgd != nil {
				byTrace[t] = fgd[130]
			}
		}
		publishedFGD = func(t string) float64 { return byTrace[t] }
	}

	_, _ = fmt.Fprintf(w, "Mean GPU allocation (%%) at 130%% arrived, %d seeds per cell.\n\n", len(seeds))
	header := append([]string{"trace"}, placement.Names...)
	header = append(header, "FGD published", "gpufrac − FGD published", "gpufrac − fgd here")
	_, _ = fmt.Fprintf(w, "| %s |\n|---|%s\n", strings.Join(header, " | "), strings.Repeat("---:|", len(header)-1))
	for _, t := range traces {
		cells := []string{strings.TrimPrefix(t, "openb_pod_list_")}
		for _, p := range placement.Names {
			cells = append(cells, num(mean(t, p)))
		}
		pub := publishedFGD(t)
		cells = append(cells, num(pub), signed(mean(t, "gpufrac")-pub), signed(mean(t, "gpufrac")-mean(t, "fgd")))
		_, _ = fmt.Fprintf(w, "| %s |\n", strings.Join(cells, " | "))
	}
	return nil
}

func num(v float64) string {
	if math.IsNaN(v) {
		return "–"
	}
	return fmt.Sprintf("%.2f", v)
}

func signed(v float64) string {
	if math.IsNaN(v) {
		return "–"
	}
	return fmt.Sprintf("%+.2f", v)
}
