from nodeagent.main import main

main()
